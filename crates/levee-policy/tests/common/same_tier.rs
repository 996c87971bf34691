//! The same-tier flood both time-simulated isolation tests run: quiet tenants and one
//! flooder of the same tier on two backends, Poisson arrivals over a 600 s run, a request
//! holding its slot about 2 s; the quiet tenants' figures.

use rand::rngs::SmallRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};
use std::time::Duration;

/// The simulated run.
pub const RUN: Duration = Duration::from_secs(600);
/// About how long a request holds its slot (what the shares below are taken at).
pub const SERVICE: Duration = Duration::from_secs(2);
/// The quiet tenants' names, as many as a mix may have.
pub const NAMES: [&str; 12] = [
    "q0", "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "q10", "q11",
];

/// A traffic mix: quiet tenants and a flooder of the same tier on a fleet of two backends.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    pub quiet: usize,
    /// Requests per second of each quiet tenant.
    pub quiet_rate: f64,
    /// Requests per second of the flooder.
    pub flood_rate: f64,
    pub slots_per_backend: usize,
    pub seed: u64,
}

impl Mix {
    /// The quiet tenants' share of the fleet's slots.
    pub fn quiet_share(&self) -> f64 {
        self.quiet as f64 * self.quiet_rate * SERVICE.as_secs_f64()
            / (2 * self.slots_per_backend) as f64
    }

    /// The flooder's weighted share of the fleet, in requests per second.
    pub fn flooder_share(&self) -> f64 {
        (2 * self.slots_per_backend) as f64 / (self.quiet + 1) as f64 / SERVICE.as_secs_f64()
    }
}

/// What the quiet tenants got, and how much the flooder was served.
#[derive(Debug, Default)]
pub struct Quiet {
    pub ttft: Vec<Duration>,
    /// Time per output token of each quiet request (where the engine model has one).
    pub tpot: Vec<Duration>,
    pub failed: usize,
    /// The flooder's requests served.
    pub flooder_served: usize,
    /// The flooder's requests cut short to give their slot to a quiet one (queued again).
    pub preempted: usize,
}

/// The 99th percentile of `v` (nearest rank).
pub fn p99(v: &mut [Duration]) -> Duration {
    v.sort();
    let i = ((v.len() as f64) * 0.99).ceil() as usize;
    v[i.saturating_sub(1).min(v.len() - 1)]
}

impl Quiet {
    pub fn p99(&mut self) -> Duration {
        p99(&mut self.ttft)
    }

    pub fn p99_tpot(&mut self) -> Duration {
        p99(&mut self.tpot)
    }

    /// The flooder's requests served per second.
    pub fn flooder_rate(&self) -> f64 {
        self.flooder_served as f64 / RUN.as_secs_f64()
    }
}

/// Arrival times (ms) of a Poisson stream of `rate` per second over the run.
pub fn arrivals(rate: f64, seed: u64) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let gap = Exp::new(rate).unwrap();
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        t += gap.sample(&mut rng);
        if t >= RUN.as_secs_f64() {
            return out;
        }
        out.push((t * 1000.0) as u64);
    }
}
