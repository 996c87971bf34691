// Test helpers outside #[test] fns may unwrap too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_sim::scenario::{Behaviour, Phase, Rate};
use levee_sim::{scenarios, Scenario};

#[test]
fn every_shipped_scenario_parses_and_round_trips() {
    for name in scenarios::names() {
        let s = scenarios::builtin(name).unwrap();
        assert_eq!(s.name, name);
        let again = Scenario::from_toml_str(&s.to_toml_string().unwrap()).unwrap();
        assert_eq!(again, s, "{name}");
    }
    assert!(scenarios::builtin("nope")
        .unwrap_err()
        .to_string()
        .contains("flash-crowd"));
}

/// The floods the bench scripts run (`bench/*.toml`) load as `levee sim` loads them.
#[test]
fn every_bench_flood_parses() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Scenario::from_file(&path).unwrap_or_else(|e| panic!("{e:#}"));
            seen += 1;
        }
    }
    assert!(seen >= 7, "found {seen} floods in {}", dir.display());
}

#[test]
fn empty_scenario_is_all_defaults() {
    let s = Scenario::from_toml_str("").unwrap();
    assert_eq!(s, Scenario::default());
    assert_eq!(s.duration_s(), 10.0);
}

#[test]
fn unknown_fields_are_named() {
    for (text, field) in [
        ("capacity = 3", "capacity"),
        ("[client]\nbehavior = \"naive\"", "behavior"),
        (
            "[[phases]]\nkind = \"steady\"\nduration_s = 1\nrps = 1\nrate = 2",
            "rate",
        ),
        (
            "[[classes]]\nprompt_tokens = { dist = \"constant\", value = 1, mean = 2 }",
            "mean",
        ),
    ] {
        let err = format!("{:#}", Scenario::from_toml_str(text).unwrap_err());
        assert!(err.contains(field), "{text:?}: {err}");
    }
}

#[test]
fn rates_scale_with_capacity_and_rate_scale() {
    let s = Scenario::from_toml_str(
        "capacity_rps = 40\nrate_scale = 0.5\n[[phases]]\nkind = \"steady\"\nduration_s = 1\nrps = \"2.5x\"\n[client]\nbehaviour = \"naive\"",
    )
    .unwrap();
    match s.phases[0] {
        Phase::Steady { rps, .. } => {
            assert_eq!(rps, Rate::Multiple(2.5));
            assert_eq!(s.resolve(rps), 50.0);
        }
        _ => panic!(),
    }
    assert_eq!(s.client.behaviour, Behaviour::Naive);
    let err = format!(
        "{:#}",
        Scenario::from_toml_str("[[phases]]\nkind = \"steady\"\nduration_s = 1\nrps = \"lots\"")
            .unwrap_err()
    );
    assert!(err.contains("2.5x"), "{err}");
}

#[test]
fn validation_explains() {
    let err = format!(
        "{:#}",
        Scenario::from_toml_str("[[phases]]\nkind = \"steady\"\nduration_s = 0\nrps = 1")
            .unwrap_err()
    );
    assert!(err.contains("phases[0].duration_s"), "{err}");
    let err = format!(
        "{:#}",
        Scenario::from_toml_str("[[faults]]\nat_s = 1\naction = \"post\"").unwrap_err()
    );
    assert!(err.contains("needs a url"), "{err}");
}

#[test]
fn time_scale_compresses_the_timeline_not_the_rates() {
    let full = scenarios::builtin("flash-crowd").unwrap();
    let mut half = full.clone();
    half.scale_time(0.5);
    assert_eq!(half.duration_s(), full.duration_s() / 2.0);
    let n_full = levee_sim::arrivals::build(&full).unwrap().arrivals.len() as f64;
    let n_half = levee_sim::arrivals::build(&half).unwrap().arrivals.len() as f64;
    assert!((n_half / n_full - 0.5).abs() < 0.05, "{n_half} vs {n_full}");
    let mut failure = scenarios::builtin("backend-failure").unwrap();
    failure.scale_time(0.5);
    assert_eq!(failure.faults[0].at_s, 7.5);
    assert_eq!(failure.faults[1].duration_s, Some(5.0));
}
