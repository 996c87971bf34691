//! The fleet's capacity: the reference every goodput verdict is judged against.

use crate::contender::Setup;
use crate::fleet::Fleet;
use crate::passthrough::Passthrough;
use crate::verdicts;
use levee_engine::EngineConfig;
use levee_sim::scenario::{Behaviour, Phase, Rate, Scenario, Tenant};
use levee_sim::RunOptions;
use rand::SeedableRng;
use std::fmt::Write as _;
use std::time::Duration;

/// How long things last: the full drill or `--quick`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// Factor on the scenario's timeline and the engines' restart time.
    pub time_scale: f64,
    /// Sweep: rates tried, as multiples of the first estimate.
    pub ladder: &'static [f64],
    /// Sweep: length of one step, and the first seconds of it left out.
    pub step_s: f64,
    pub step_warm_s: f64,
    /// Sweep: it ends after this many steps in a row add less than 2% over the best.
    pub flat_steps_to_stop: u32,
    /// After a run's last scheduled send, how long requests still in flight may finish.
    pub drain_s: f64,
    /// First seconds of a flood stretch left out of the goodput window.
    pub flood_warm_s: f64,
}

pub(crate) const FULL: Timing = Timing {
    time_scale: 1.0,
    ladder: &[0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 1.75],
    step_s: 10.0,
    step_warm_s: 4.0,
    flat_steps_to_stop: 1,
    drain_s: 6.0,
    flood_warm_s: 2.0,
};

/// Real servers (`--backend`) on CPUs serve a few requests per second, each lasting
/// seconds, at a speed that follows the machine's load: longer sweep steps, so that a
/// step's goodput counts enough requests, and one flat step does not end the sweep.
pub(crate) const EXTERNAL: Timing = Timing {
    time_scale: 1.0,
    ladder: &[0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 1.75],
    step_s: 30.0,
    step_warm_s: 8.0,
    flat_steps_to_stop: 2,
    drain_s: 10.0,
    flood_warm_s: 2.0,
};

pub(crate) const QUICK: Timing = Timing {
    time_scale: 0.2,
    ladder: &[0.5, 0.75, 1.0, 1.25],
    step_s: 5.0,
    step_warm_s: 2.0,
    flat_steps_to_stop: 1,
    drain_s: 2.0,
    flood_warm_s: 1.0,
};

/// One step of the capacity sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SweepStep {
    pub offered_rps: f64,
    pub goodput_rps: f64,
    pub crashed: bool,
}

/// The capacity sweep's result.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sweep {
    pub steps: Vec<SweepStep>,
    pub knee_rps: f64,
}

/// The scenario's request mix offered steadily at `rps` for `secs`: its classes and sessions
/// from one tenant, no retries, no faults.
pub(crate) fn sweep_scenario(base: &Scenario, rps: f64, secs: f64) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} (capacity sweep at {rps:.1} req/s)", base.name);
    s.phases = vec![Phase::Steady {
        duration_s: secs,
        rps: Rate::Rps(rps),
    }];
    s.rate_scale = 1.0;
    s.tenants = vec![Tenant::default()];
    s.faults.clear();
    s.client.behaviour = Behaviour::None;
    s.client.max_attempts = 1;
    s
}

/// A first guess of the fleet's capacity for the scenario's mix, only to place the sweep's
/// steps: per engine, the sequences whose prompt and output fit the KV cache (at most its
/// sequence limit), each producing its output at one decode step per token.
pub(crate) fn estimated_capacity(
    scenario: &Scenario,
    engines: usize,
    engine: &EngineConfig,
) -> f64 {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(scenario.seed);
    let total_weight: f64 = scenario.classes.iter().map(|c| c.weight.max(0.0)).sum();
    let (mut prompt, mut output) = (0.0, 0.0);
    for c in &scenario.classes {
        let w = c.weight.max(0.0) / total_weight.max(1e-9);
        let n = 500;
        let (mut p, mut o) = (0.0, 0.0);
        for _ in 0..n {
            p += c.prompt_tokens.sample(&mut rng);
            let natural = f64::from(
                engine.output_tokens_min
                    + (engine.output_tokens_max - engine.output_tokens_min) / 2,
            );
            o += c.max_tokens.sample(&mut rng).min(natural);
        }
        prompt += w * p / f64::from(n);
        output += w * o / f64::from(n);
    }
    let g = &engine.gpu;
    let per_seq = (prompt + output).max(1.0);
    // Arrivals are random: keep the cache 60% full on average so that bursts fit.
    let seqs = (0.6 * f64::from(g.kv_capacity_tokens) / per_seq).min(f64::from(g.max_running_seqs));
    let step_s = (g.decode_base_ms + g.decode_per_seq_ms * seqs) / 1000.0;
    engines as f64 * seqs / (output.max(1.0) * step_s)
}

/// One step of the sweep: `rps` of the scenario's mix on fresh engines behind the plain
/// proxy; goodput over `window` (seconds of the step).
async fn sweep_step(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
    rps: f64,
    opts: &RunOptions,
    window: &[u32],
) -> anyhow::Result<SweepStep> {
    let s = sweep_scenario(scenario, rps, timing.step_s);
    let fleet = Fleet::start(setup).await?;
    let proxy = Passthrough::start(fleet.urls()).await?;
    let target = fleet.target(proxy.base_url());
    let run = fleet.run(&s, &target, opts).await;
    proxy.shutdown().await;
    let crashed = fleet.stop().await.crashes > 0;
    let (report, _) = run?;
    Ok(SweepStep {
        offered_rps: rps,
        goodput_rps: verdicts::window_goodput(&report, window).unwrap_or(0.0),
        crashed,
    })
}

/// The capacity sweep (see the crate documentation).
pub(crate) async fn measure_knee(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
) -> anyhow::Result<Sweep> {
    let estimate = estimated_capacity(scenario, setup.engines, &setup.engine);
    let mut steps: Vec<SweepStep> = Vec::new();
    let opts = RunOptions {
        drain: Some(Duration::from_millis(500)),
        ..setup.opts.clone()
    };
    let window: Vec<u32> = (timing.step_warm_s as u32..timing.step_s as u32).collect();
    let mut rates: Vec<f64> = timing.ladder.iter().map(|m| estimate * m).collect();
    let mut i = 0;
    let mut flat_steps = 0;
    while i < rates.len() {
        let rps = rates[i];
        let step = sweep_step(scenario, setup, timing, rps, &opts, &window).await?;
        eprintln!(
            "      {rps:>6.1} req/s offered → {:>6.1} req/s within the SLO{}",
            step.goodput_rps,
            if step.crashed {
                "  (an engine crashed)"
            } else {
                ""
            }
        );
        let best_before = steps
            .iter()
            .filter(|s| !s.crashed)
            .map(|s| s.goodput_rps)
            .fold(0.0, f64::max);
        let saturated = step.crashed || step.goodput_rps < 0.8 * rps;
        steps.push(step);
        if i == 0 && saturated && steps.len() == 1 {
            // The first guess was already past the knee: start lower.
            rates[0] = rps * 0.5;
            continue;
        }
        if i > 0 && step.goodput_rps < best_before * 1.02 {
            flat_steps += 1;
        } else {
            flat_steps = 0;
        }
        if step.crashed || flat_steps >= timing.flat_steps_to_stop {
            break;
        }
        i += 1;
    }
    let knee = steps
        .iter()
        .filter(|s| !s.crashed)
        .map(|s| s.goodput_rps)
        .fold(0.0, f64::max);
    anyhow::ensure!(
        knee > 0.5,
        "the capacity sweep found no crash-free step with goodput (steps: {steps:?}); the \
         engines cannot serve this scenario's mix within its SLO"
    );
    Ok(Sweep {
        steps,
        knee_rps: knee,
    })
}

/// The sweep as text; `at` says what the steps went straight at.
pub(crate) fn render_sweep(sweep: &Sweep, timing: &Timing, at: &str) -> String {
    let mut s = format!(
        "capacity without levee: open-loop steps of {:.0} s straight at {at}, the scenario's \
         mix, no retries; goodput = requests within the SLO per second after {:.0} s\n",
        timing.step_s, timing.step_warm_s
    );
    for st in &sweep.steps {
        let _ = writeln!(
            s,
            "  offered {:>6.1} req/s → goodput {:>6.1} req/s{}",
            st.offered_rps,
            st.goodput_rps,
            if st.crashed {
                "  (a server crashed: not counted)"
            } else {
                ""
            }
        );
    }
    let _ = write!(s, "  knee: {:.1} req/s", sweep.knee_rps);
    s
}
