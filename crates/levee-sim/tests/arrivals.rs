//! Statistical checks of the generated schedules (fixed seeds, so deterministic).

// Test helpers outside #[test] fns may unwrap too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_sim::arrivals::{arrival_times, build};
use levee_sim::scenario::{Phase, Process, Rate};
use levee_sim::Scenario;
use rand::rngs::SmallRng;
use rand::SeedableRng;

fn steady(duration_s: f64, rps: f64) -> Vec<Phase> {
    vec![Phase::Steady {
        duration_s,
        rps: Rate::Rps(rps),
    }]
}

fn times(phases: &[Phase], process: Process, burstiness: f64, seed: u64) -> Vec<f64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    arrival_times(phases, &|r| r.rps(1.0), process, burstiness, &mut rng)
}

/// Index of dispersion (variance / mean) of counts in `window`-second bins.
fn dispersion(times: &[f64], duration: f64, window: f64) -> (f64, f64) {
    let bins = (duration / window) as usize;
    let mut counts = vec![0f64; bins];
    for &t in times {
        let i = (t / window) as usize;
        if i < bins {
            counts[i] += 1.0;
        }
    }
    let mean = counts.iter().sum::<f64>() / bins as f64;
    let var = counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / (bins - 1) as f64;
    (mean, var / mean)
}

#[test]
fn constant_is_exact_and_evenly_spaced() {
    let t = times(&steady(10.0, 100.0), Process::Constant, 1.0, 1);
    assert_eq!(t.len(), 1000);
    for w in t.windows(2) {
        assert!((w[1] - w[0] - 0.01).abs() < 1e-6, "gap {}", w[1] - w[0]);
    }
    let (_, d) = dispersion(&t, 10.0, 1.0);
    assert!(d < 0.05, "constant arrivals should not disperse: {d}");
}

#[test]
fn poisson_matches_rate_and_dispersion_one() {
    for seed in [1, 2, 3] {
        let t = times(&steady(200.0, 100.0), Process::Poisson, 1.0, seed);
        let rate = t.len() as f64 / 200.0;
        assert!((rate - 100.0).abs() < 3.0, "seed {seed}: rate {rate}");
        let (_, d) = dispersion(&t, 200.0, 1.0);
        assert!(
            (0.75..1.25).contains(&d),
            "seed {seed}: Poisson dispersion {d}"
        );
    }
}

#[test]
fn gamma_matches_rate_and_its_burstiness() {
    for (b, seed) in [(4.0, 1), (0.25, 2), (9.0, 3)] {
        let t = times(&steady(400.0, 100.0), Process::Gamma, b, seed);
        let rate = t.len() as f64 / 400.0;
        assert!((rate - 100.0).abs() < 5.0, "b={b}: rate {rate}");
        let (_, d) = dispersion(&t, 400.0, 2.0);
        assert!(
            (d / b - 1.0).abs() < 0.3,
            "b={b}: dispersion {d} should be close to the burstiness"
        );
    }
}

#[test]
fn phases_follow_their_rate_curves() {
    let phases = vec![
        Phase::Ramp {
            duration_s: 100.0,
            from_rps: Rate::Rps(0.0),
            to_rps: Rate::Rps(100.0),
        },
        Phase::Step {
            duration_s: 20.0,
            from_rps: Rate::Rps(10.0),
            to_rps: Rate::Rps(200.0),
            at_s: 10.0,
        },
        Phase::Spike {
            duration_s: 30.0,
            base_rps: Rate::Rps(20.0),
            peak_rps: Rate::Rps(500.0),
            at_s: 10.0,
            length_s: 5.0,
        },
        Phase::Sine {
            duration_s: 100.0,
            mean_rps: Rate::Rps(50.0),
            amplitude_rps: Rate::Rps(40.0),
            period_s: 20.0,
        },
    ];
    let t = times(&phases, Process::Poisson, 1.0, 9);
    let count = |a: f64, b: f64| t.iter().filter(|&&x| x >= a && x < b).count() as f64;
    let close = |got: f64, want: f64| (got - want).abs() <= 4.0 * want.sqrt() + 1.0;
    // Ramp: ∫0..100 t dt = 5000; its first half holds a quarter.
    assert!(close(count(0.0, 100.0), 5000.0), "{}", count(0.0, 100.0));
    assert!(close(count(0.0, 50.0), 1250.0), "{}", count(0.0, 50.0));
    // Step at 110 s.
    assert!(close(count(100.0, 110.0), 100.0), "{}", count(100.0, 110.0));
    assert!(
        close(count(110.0, 120.0), 2000.0),
        "{}",
        count(110.0, 120.0)
    );
    // Spike at 130..135 s.
    assert!(
        close(count(130.0, 135.0), 2500.0),
        "{}",
        count(130.0, 135.0)
    );
    assert!(close(count(120.0, 130.0), 200.0), "{}", count(120.0, 130.0));
    // Sine: whole periods average to the mean; the rising half-period holds more.
    assert!(
        close(count(150.0, 250.0), 5000.0),
        "{}",
        count(150.0, 250.0)
    );
    let high = count(150.0, 160.0);
    let low = count(160.0, 170.0);
    assert!(
        high > 1.8 * low,
        "sine peak half {high} vs trough half {low}"
    );
}

#[test]
fn same_seed_same_schedule_and_other_seed_differs() {
    let scenario = levee_sim::scenarios::builtin("steady").unwrap();
    let a = build(&scenario).unwrap();
    let b = build(&scenario).unwrap();
    assert_eq!(a, b);
    let mut other = scenario.clone();
    other.seed += 1;
    assert_ne!(build(&other).unwrap().arrivals, a.arrivals);
}

#[test]
fn mixes_follow_weights_and_shares() {
    let scenario = Scenario::from_toml_str(
        r#"
        capacity_rps = 100
        [[phases]]
        kind = "steady"
        duration_s = 100
        rps = "1x"
        [[classes]]
        name = "a"
        weight = 3
        prompt_tokens = { dist = "constant", value = 10 }
        slow_share = 0.1
        slow_prompt_tokens = { dist = "constant", value = 9999 }
        [[classes]]
        name = "b"
        weight = 1
        [[tenants]]
        name = "x"
        share = 1
        [[tenants]]
        name = "y"
        share = 1
        [[tenants]]
        name = "z"
        share = 0
        phases = [{ kind = "steady", duration_s = 200, rps = 10 }]
        [sessions]
        share = 0.2
        "#,
    )
    .unwrap();
    let s = build(&scenario).unwrap();
    let n = s.arrivals.len() as f64;
    let frac = |f: &dyn Fn(&levee_sim::arrivals::Arrival) -> bool| {
        s.arrivals.iter().filter(|a| f(a)).count() as f64 / n
    };
    assert!((frac(&|a| a.class == 0) - 0.75).abs() < 0.02);
    // Tenant z only has its own 10 rps, cut at the run's 100 s: 1,000 requests, every turn
    // counted, so 1000 / 1.4 conversations (a fifth of them bring two more turns).
    assert!((scenario.turns_per_arrival() - 1.4).abs() < 1e-12);
    let z: Vec<_> = s.arrivals.iter().filter(|a| a.tenant == 2).collect();
    let conversations = z.len() as f64;
    assert!(
        (conversations - 1000.0 / 1.4).abs() < 100.0,
        "{conversations}"
    );
    let turns: f64 = z.iter().map(|a| f64::from(a.turns)).sum();
    assert!((turns - 1000.0).abs() < 130.0, "{turns}");
    // The share tenants' 1x (100 rps) likewise: 10,000 requests with their later turns.
    let shared: f64 = s
        .arrivals
        .iter()
        .filter(|a| a.tenant != 2)
        .map(|a| f64::from(a.turns))
        .sum();
    assert!((shared - 10_000.0).abs() < 400.0, "{shared}");
    assert!((scenario.offered_rps_at(50.0) - 110.0).abs() < 1e-9);
    assert!(s.arrivals.iter().all(|a| a.at_ns < 100_000_000_000));
    let slow = s.arrivals.iter().filter(|a| a.slow).count() as f64;
    let class_a = s.arrivals.iter().filter(|a| a.class == 0).count() as f64;
    assert!((slow / class_a - 0.1).abs() < 0.02);
    assert!(s
        .arrivals
        .iter()
        .filter(|a| a.slow)
        .all(|a| a.prompt_tokens == 9999 && a.class == 0));
    assert!((frac(&|a| a.turns > 1) - 0.2).abs() < 0.02);
    assert!(s.arrivals.windows(2).all(|w| w[0].at_ns <= w[1].at_ns));
}

#[test]
fn a_tenant_with_its_own_class_leaves_everyone_elses_requests_unchanged() {
    let mut s = Scenario {
        phases: steady(20.0, 30.0),
        ..Default::default()
    };
    s.classes.push(levee_sim::scenario::Class {
        name: "long-job".into(),
        weight: 0.0,
        max_tokens: levee_sim::dist::Dist::Constant { value: 2000.0 },
        ..Default::default()
    });
    let base = build(&s).unwrap();
    s.tenants.push(levee_sim::scenario::Tenant {
        name: "batch".into(),
        share: 0.0,
        phases: Some(steady(20.0, 2.0)),
        class: Some("long-job".into()),
        ..Default::default()
    });
    let with = build(&s).unwrap();
    let others: Vec<_> = with
        .arrivals
        .iter()
        .filter(|a| a.tenant == 0)
        .copied()
        .collect();
    assert_eq!(others, base.arrivals, "interactive requests identical");
    let batch: Vec<_> = with.arrivals.iter().filter(|a| a.tenant == 1).collect();
    assert!(batch.len() > 20, "{}", batch.len());
    assert!(batch.iter().all(|a| a.class == 1 && a.max_tokens == 2000));
    // The mix never draws a zero-weight class.
    assert!(base.arrivals.iter().all(|a| a.class == 0));
}
