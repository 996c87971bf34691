//! Measures each model's demand and keeps its backend replica recommendation.
//!
//! The request path counts arrivals (requests that reach admission) and completions per
//! model. Once a second the gateway samples
//! each lane (queued requests, busy backend slots, slots per backend) and this module turns
//! the samples of the last `autoscale.window_ms` into the policy's inputs:
//!
//! - arrival rate λ = arrivals in the window / its length;
//! - service rate of one slot μ = completions per second / mean busy slots (Little's law:
//!   busy slots = throughput × time a request holds a slot);
//!
//! and asks [`levee_policy::Autoscaler`] for the figure (formula in that module).

use crate::config::AutoscaleConfig;
use levee_policy::{Autoscaler, Demand, Timestamp};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Demand counters and recommendations of every model.
#[derive(Debug, Default)]
pub struct Scaling {
    models: RwLock<HashMap<String, Arc<ModelDemand>, levee_policy::FastState>>,
}

#[derive(Debug)]
struct ModelDemand {
    arrivals: AtomicU64,
    completions: AtomicU64,
    state: Mutex<DemandState>,
}

#[derive(Debug)]
struct DemandState {
    samples: VecDeque<Sample>,
    autoscaler: Autoscaler,
    last_service_rate: Option<f64>,
    last: Option<ScaleSnapshot>,
    /// On a fleet: the other live replicas' arrivals per second and queued requests, and
    /// how many replicas published them (this one included), from the shared state.
    others: Option<(f64, u64, u32)>,
    /// This replica's own arrival rate and queue at the last sample (what it publishes).
    local: (f64, u64),
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Timestamp,
    arrivals: u64,
    completions: u64,
    busy: f64,
}

/// One lane's state at a sampling tick.
#[derive(Debug, Clone, Copy)]
pub struct LaneSample {
    /// Requests queued in the lane.
    pub queued: u64,
    /// Requests levee has in flight at the lane's backends.
    pub busy_slots: u64,
    /// Concurrent sequences one backend serves (mean of the backends' `max_in_flight`).
    pub slots_per_replica: u32,
}

/// The recommendation and what it was computed from (`/admin/state`).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct ScaleSnapshot {
    /// Backend replicas to run now.
    pub replicas: u32,
    /// What the traffic alone needs (before the warm pool, limits and hold).
    pub needed: u32,
    /// The rule that set `needed`.
    pub bound: &'static str,
    /// A lower figure is waiting out the scale-in hold.
    pub holding: bool,
    /// Measured arrivals per second.
    pub arrival_rate: f64,
    /// Measured completions per second of one busy slot (`null` before any).
    pub service_rate: Option<f64>,
    /// Queued now.
    pub queued: u64,
    /// Mean busy slots over the window.
    pub busy_slots: f64,
    /// Offered load in busy slots (arrival rate, backlog included, over service rate).
    pub offered_load: f64,
    /// Slots per replica used.
    pub slots_per_replica: u32,
    /// Gateway replicas whose arrivals and queues are counted (1 alone; on a fleet, those
    /// that published theirs through the shared state lately).
    pub gateways: u32,
}

impl DemandState {
    /// Adds `last` to the samples of the last `window` and measures over them: the arrival
    /// rate, the service rate per busy slot (`None` until completions were seen), and the
    /// mean busy slots, each sample standing for the interval it ends (the intervals the
    /// completions were counted in).
    fn rates(&mut self, last: Sample, window: Duration) -> (f64, Option<f64>, f64) {
        let now = last.at;
        self.samples.push_back(last);
        while self
            .samples
            .front()
            .is_some_and(|s| now.saturating_duration_since(s.at) > window)
        {
            self.samples.pop_front();
        }
        let first = self.samples.front().copied().unwrap_or(last);
        let span = last.at.saturating_duration_since(first.at).as_secs_f64();
        if span <= 0.0 {
            return (0.0, None, last.busy);
        }
        let busy = self
            .samples
            .iter()
            .zip(self.samples.iter().skip(1))
            .map(|(prev, cur)| cur.busy * cur.at.saturating_duration_since(prev.at).as_secs_f64())
            .sum::<f64>()
            / span;
        let lambda = last.arrivals.saturating_sub(first.arrivals) as f64 / span;
        let throughput = last.completions.saturating_sub(first.completions) as f64 / span;
        let mu = (throughput > 0.0 && busy > 0.0).then(|| throughput / busy);
        (lambda, mu, busy)
    }
}

impl Scaling {
    fn model(&self, model: &str) -> Option<Arc<ModelDemand>> {
        self.models.read().get(model).cloned()
    }

    /// Counts a request for `model` that reaches admission.
    pub fn arrival(&self, model: &str) {
        // Counted under the map's read lock: a clone of the `Arc` would cost every request
        // two more atomic writes to a count both workers share.
        if let Some(m) = self.models.read().get(model) {
            m.arrivals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a request of `model` that a backend finished (any outcome).
    pub fn completion(&self, model: &str) {
        if let Some(m) = self.models.read().get(model) {
            m.completions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The demand of `model`, created on first use.
    fn model_or_new(
        &self,
        model: &str,
        policy: &levee_policy::AutoscaleConfig,
    ) -> Arc<ModelDemand> {
        if let Some(m) = self.model(model) {
            return m;
        }
        self.models
            .write()
            .entry(model.to_string())
            .or_insert_with(|| {
                Arc::new(ModelDemand {
                    arrivals: AtomicU64::new(0),
                    completions: AtomicU64::new(0),
                    state: Mutex::new(DemandState {
                        samples: VecDeque::new(),
                        autoscaler: Autoscaler::new(policy.clone()),
                        last_service_rate: None,
                        last: None,
                        others: None,
                        local: (0.0, 0),
                    }),
                })
            })
            .clone()
    }

    /// Takes one sample of `model`'s lane at `now` and returns the updated recommendation.
    pub fn observe(
        &self,
        model: &str,
        lane: LaneSample,
        cfg: &AutoscaleConfig,
        now: Timestamp,
    ) -> ScaleSnapshot {
        let policy = cfg.to_policy(lane.slots_per_replica);
        let m = self.model_or_new(model, &policy);
        let mut st = m.state.lock();
        st.autoscaler.reconfigure(policy);
        let last = Sample {
            at: now,
            arrivals: m.arrivals.load(Ordering::Relaxed),
            completions: m.completions.load(Ordering::Relaxed),
            busy: lane.busy_slots as f64,
        };
        let (arrival_rate, service_rate, busy) =
            st.rates(last, Duration::from_millis(cfg.window_ms));
        if service_rate.is_some() {
            st.last_service_rate = service_rate;
        }
        let service_rate = service_rate.or(st.last_service_rate);
        st.local = (arrival_rate, lane.queued);
        // The fleet's demand: this replica's and what the others published.
        let (others_rate, others_queued, gateways) = st.others.unwrap_or((0.0, 0, 1));
        let arrival_rate = arrival_rate + others_rate;
        let queued = lane.queued + others_queued;
        let rec = st.autoscaler.observe(
            &Demand {
                arrival_rate,
                service_rate,
                queued,
            },
            now,
        );
        let snap = ScaleSnapshot {
            replicas: rec.replicas,
            needed: rec.needed,
            bound: rec.bound.as_str(),
            holding: rec.holding,
            arrival_rate,
            service_rate,
            queued,
            busy_slots: busy,
            offered_load: rec.offered_load,
            slots_per_replica: lane.slots_per_replica,
            gateways,
        };
        st.last = Some(snap);
        snap
    }

    /// This replica's own demand for `model` at its last sample: arrivals per second and
    /// requests queued (what it publishes to the fleet).
    pub fn local_demand(&self, model: &str) -> Option<(f64, u64)> {
        self.model(model).map(|m| m.state.lock().local)
    }

    /// Sets what the other replicas of the fleet published for `model` (arrivals per
    /// second, queued, replicas publishing including this one); the next sample adds it to
    /// this replica's own. `None`: the shared state did not answer, this replica's alone
    /// counts until it does.
    pub fn set_fleet_demand(&self, model: &str, others: Option<(f64, u64, u32)>) {
        if let Some(m) = self.model(model) {
            m.state.lock().others = others;
        }
    }

    /// The last recommendation of every model, by model name.
    pub fn state_json(&self) -> serde_json::Value {
        let models = self.models.read();
        let mut out = serde_json::Map::new();
        for (name, m) in models.iter() {
            if let Some(s) = m.state.lock().last {
                out.insert(name.clone(), serde_json::json!(s));
            }
        }
        serde_json::Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_nanos(ms * 1_000_000)
    }

    #[test]
    fn rates_come_from_the_window_and_littles_law() {
        let s = Scaling::default();
        let cfg = AutoscaleConfig {
            min_replicas: 1,
            warm_pool: 0,
            window_ms: 10_000,
            ..AutoscaleConfig::default()
        };
        let lane = LaneSample {
            queued: 0,
            busy_slots: 20,
            slots_per_replica: 8,
        };
        // The first sample registers the model; counting starts from here.
        let first = s.observe("m", lane, &cfg, at(0));
        assert_eq!(first.service_rate, None);
        // 10 s at 10 arrivals/s and 10 completions/s with 20 slots busy: μ = 10 / 20 = 0.5
        // per slot, a = 20 erlangs, 20 / (8 · 0.8) = 3.1 ⇒ 4 replicas.
        for sec in 1..=10 {
            for _ in 0..10 {
                s.arrival("m");
                s.completion("m");
            }
            s.observe("m", lane, &cfg, at(sec * 1000));
        }
        let snap = s.observe("m", lane, &cfg, at(10_000));
        assert!((snap.arrival_rate - 10.0).abs() < 1e-9, "{snap:?}");
        assert!((snap.service_rate.unwrap() - 0.5).abs() < 1e-9, "{snap:?}");
        assert_eq!(snap.replicas, 4);
        // Arrivals stop and the backends empty: λ falls to zero within the window; μ stays
        // exact while the window still holds completions, and is then kept.
        let idle = LaneSample {
            busy_slots: 0,
            ..lane
        };
        for sec in 11..=21 {
            let snap = s.observe("m", idle, &cfg, at(sec * 1000));
            assert!(
                (snap.service_rate.unwrap() - 0.5).abs() < 1e-9,
                "{sec}: {snap:?}"
            );
        }
        let snap = s.observe("m", idle, &cfg, at(21_000));
        assert_eq!(snap.arrival_rate, 0.0);
        assert!((snap.service_rate.unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(
            s.state_json()["m"]["replicas"],
            4,
            "held by the scale-in hold"
        );
    }

    #[test]
    fn a_fleet_counts_every_replicas_arrivals_and_queue() {
        let s = Scaling::default();
        let cfg = AutoscaleConfig {
            min_replicas: 1,
            warm_pool: 0,
            window_ms: 10_000,
            ..AutoscaleConfig::default()
        };
        let lane = LaneSample {
            queued: 3,
            busy_slots: 20,
            slots_per_replica: 8,
        };
        s.observe("m", lane, &cfg, at(0));
        for sec in 1..=10 {
            for _ in 0..10 {
                s.arrival("m");
                s.completion("m");
            }
            s.observe("m", lane, &cfg, at(sec * 1000));
        }
        let alone = s.observe("m", lane, &cfg, at(10_000));
        assert_eq!(alone.gateways, 1);
        assert_eq!(s.local_demand("m"), Some((10.0, 3)));
        // Two other replicas take as much again each.
        s.set_fleet_demand("m", Some((20.0, 6, 3)));
        let fleet = s.observe("m", lane, &cfg, at(10_000));
        assert!((fleet.arrival_rate - 30.0).abs() < 1e-9, "{fleet:?}");
        assert_eq!((fleet.queued, fleet.gateways), (9, 3));
        assert!(fleet.replicas > alone.replicas, "{fleet:?} vs {alone:?}");
        // What it publishes stays its own.
        assert_eq!(s.local_demand("m"), Some((10.0, 3)));
    }
}
