//! The open-loop schedule: every request's intended send time and shape, computed before
//! the run from the scenario and its seed.
//!
//! Arrival times come from a unit-rate renewal process (gaps with mean 1: constant,
//! exponential or gamma) mapped through the integrated rate Λ(t) = ∫ r: the i-th arrival is
//! at Λ⁻¹(g₁ + … + gᵢ). This "time rescaling" keeps the process's shape (Poisson stays
//! Poisson, gamma keeps its burstiness) while following any rate curve.

use crate::scenario::{Phase, Process, Rate, Scenario};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::weighted::WeightedIndex;
use rand_distr::{Distribution, Exp1, Gamma};

/// One scheduled request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// Intended send time, in nanoseconds from the start of the run.
    pub at_ns: u64,
    /// Index into `Scenario::tenants`.
    pub tenant: u16,
    /// Index into `Scenario::classes`.
    pub class: u16,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// `max_tokens` of the request.
    pub max_tokens: u32,
    /// Whether it is one of the class's slow requests.
    pub slow: bool,
    /// Turns of the session this request starts (1 = a single request).
    pub turns: u16,
}

/// The whole schedule of a run, sorted by intended send time.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Arrivals, sorted by `at_ns`.
    pub arrivals: Vec<Arrival>,
    /// Length of the run in seconds (the phases' total).
    pub duration_s: f64,
}

/// Integration step of the rate curve: fine enough that a sine or ramp is followed to well
/// under a millisecond, coarse enough to cost nothing (60 000 steps per minute).
const STEP_S: f64 = 0.001;

/// Arrival times in seconds for `phases`, one after another from t = 0.
pub fn arrival_times(
    phases: &[Phase],
    rps: &dyn Fn(Rate) -> f64,
    process: Process,
    burstiness: f64,
    rng: &mut SmallRng,
) -> Vec<f64> {
    let gamma = Gamma::new(1.0 / burstiness.max(1e-6), burstiness.max(1e-6)).ok();
    let gap = |rng: &mut SmallRng| -> f64 {
        match process {
            Process::Constant => 1.0,
            Process::Poisson => Exp1.sample(rng),
            Process::Gamma => gamma.as_ref().map_or(1.0, |g| g.sample(rng)),
        }
    };
    let mut times = Vec::new();
    // Constant arrivals start half a gap in, so a phase of n/r seconds holds exactly n.
    let mut target = match process {
        Process::Constant => 0.5,
        _ => gap(rng),
    };
    let mut lambda = 0.0;
    let mut offset = 0.0;
    for phase in phases {
        let d = phase.duration_s();
        let steps = (d / STEP_S).ceil().max(1.0) as u64;
        let h = d / steps as f64;
        for i in 0..steps {
            let t0 = i as f64 * h;
            // The rate is taken as constant over a step (its midpoint value), which makes
            // the inversion exact for steady, step and spike phases.
            let r = phase.rate_at(t0 + h / 2.0, rps);
            let mut local = 0.0;
            loop {
                let need = target - lambda;
                if r <= 0.0 || need > r * (h - local) {
                    lambda += r * (h - local);
                    break;
                }
                local += need / r;
                lambda = target;
                times.push(offset + t0 + local);
                target += gap(rng);
            }
        }
        offset += d;
    }
    times
}

/// Builds the schedule of a scenario. The same scenario (and seed) always gives the same
/// schedule.
pub fn build(scenario: &Scenario) -> anyhow::Result<Schedule> {
    let seed = scenario.seed;
    // A rate counts every turn; new conversations arrive at its share of first turns.
    let per_arrival = scenario.turns_per_arrival();
    let rps = |r: Rate| scenario.resolve(r) / per_arrival;
    let arrival = scenario.arrival;
    // Separate generators per concern, so that e.g. adding a class does not move arrivals.
    let mut time_rng = SmallRng::seed_from_u64(seed ^ 0x7469_6d65);
    let mut mix_rng = SmallRng::seed_from_u64(seed ^ 0x006d_6978);

    let tenant_weights: Vec<f64> = scenario.tenants.iter().map(|t| t.share).collect();
    let class_weights: Vec<f64> = scenario.classes.iter().map(|c| c.weight.max(0.0)).collect();
    let class_index = WeightedIndex::new(&class_weights)
        .map_err(|e| anyhow::anyhow!("class weights cannot be used: {e}"))?;
    let tenant_index = WeightedIndex::new(&tenant_weights).ok();

    let mut tagged: Vec<(f64, u16)> = Vec::new();
    if let Some(tenant_index) = &tenant_index {
        for t in arrival_times(
            &scenario.phases,
            &rps,
            arrival.process,
            arrival.burstiness,
            &mut time_rng,
        ) {
            tagged.push((t, tenant_index.sample(&mut mix_rng) as u16));
        }
    }
    let duration_s = scenario.duration_s();
    for (i, tenant) in scenario.tenants.iter().enumerate() {
        if let Some(phases) = &tenant.phases {
            let mut own_rng = SmallRng::seed_from_u64(seed ^ (0x7465_6e00 + i as u64));
            for t in arrival_times(
                phases,
                &rps,
                arrival.process,
                arrival.burstiness,
                &mut own_rng,
            ) {
                // A tenant's own phases never extend the run.
                if t < duration_s {
                    tagged.push((t, i as u16));
                }
            }
        }
    }
    tagged.sort_by(|a, b| a.0.total_cmp(&b.0));

    let sessions = &scenario.sessions;
    // Tenants with a class of their own draw from generators of their own.
    let mut own: Vec<Option<(usize, SmallRng)>> = scenario
        .tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let class = scenario
                .classes
                .iter()
                .position(|c| Some(&c.name) == t.class.as_ref())?;
            Some((
                class,
                SmallRng::seed_from_u64(seed ^ (0x636c_6100 + i as u64)),
            ))
        })
        .collect();
    let mut arrivals = Vec::with_capacity(tagged.len());
    for (t, tenant) in tagged {
        let (class, rng) = match own.get_mut(usize::from(tenant)).and_then(Option::as_mut) {
            Some((class, rng)) => (*class, rng),
            None => (class_index.sample(&mut mix_rng), &mut mix_rng),
        };
        let c = &scenario.classes[class];
        let slow = c.slow_share > 0.0 && rng.random_bool(c.slow_share.clamp(0.0, 1.0));
        let (p, m) = if slow {
            (&c.slow_prompt_tokens, &c.slow_max_tokens)
        } else {
            (&c.prompt_tokens, &c.max_tokens)
        };
        let prompt_tokens = p.sample(rng).round().clamp(1.0, u32::MAX as f64) as u32;
        let max_tokens = m.sample(rng).round().clamp(1.0, u32::MAX as f64) as u32;
        let turns = if sessions.share > 0.0 && rng.random_bool(sessions.share.clamp(0.0, 1.0)) {
            sessions
                .turns
                .sample(rng)
                .round()
                .clamp(1.0, u16::MAX as f64) as u16
        } else {
            1
        };
        arrivals.push(Arrival {
            at_ns: (t * 1e9) as u64,
            tenant,
            class: class as u16,
            prompt_tokens,
            max_tokens,
            slow,
            turns,
        });
    }
    Ok(Schedule {
        arrivals,
        duration_s,
    })
}
