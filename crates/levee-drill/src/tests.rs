//! Tests of the drill's pieces that need no run.

use crate::capacity::{estimated_capacity, sweep_scenario};
use crate::operator::premium_over_quota;
use crate::tenants::{calm_flooders, is_flooder, quiet_groups};
use crate::{drill_engine_config, gateway_config, SHIPPED_GATEWAY_CONFIG};
use levee_sim::scenario::Behaviour;
use levee_sim::Scenario;

fn urls(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("http://127.0.0.1:{}", 1 + i))
        .collect()
}

#[test]
fn the_flooders_are_found_from_the_scenario_not_from_the_gateway_config() {
    let mut s = levee_sim::scenarios::builtin("noisy-neighbor").unwrap();
    s.capacity_rps = 20.0;
    let flooders: Vec<&str> = s
        .tenants
        .iter()
        .filter(|t| is_flooder(&s, t))
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(flooders, ["noisy"]);
    // flash-crowd's premium tenants have their own schedules but never flood.
    let fc = levee_sim::scenarios::builtin("flash-crowd").unwrap();
    assert!(fc.tenants.iter().all(|t| !is_flooder(&fc, t)));
    // The calm variant keeps the flooder at its starting rate all along.
    let calm = calm_flooders(&s);
    let n = calm.tenants.iter().find(|t| t.name == "noisy").unwrap();
    assert!(!is_flooder(&calm, n));
    let groups = quiet_groups(&s);
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].group.as_deref(), Some("quiet"));
}

#[test]
fn the_noisy_neighbour_floods_inside_the_quiet_tenants_tier() {
    let s = levee_sim::scenarios::builtin("noisy-neighbor").unwrap();
    let noisy = s.tenants.iter().find(|t| t.name == "noisy").unwrap();
    assert!(s
        .tenants
        .iter()
        .filter(|t| t.name.starts_with("quiet"))
        .all(|t| t.tier == noisy.tier));
}

#[test]
fn the_shipped_config_fits_every_shipped_scenario_without_knowing_the_flooder() {
    for name in levee_sim::scenarios::names() {
        let s = levee_sim::scenarios::builtin(name).unwrap();
        let cfg = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(2))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(cfg.models[0].backends.len(), 2);
        assert_eq!(cfg.models[0].backends[1].url, "http://127.0.0.1:2");
        // Every backend is capped at the engine's sequence capacity.
        for b in &cfg.models[0].backends {
            assert_eq!(b.max_in_flight, drill_engine_config().gpu.max_running_seqs);
        }
        // Quotas depend on the tier alone: the flooder gets the same as its peers.
        for t in &cfg.tenants {
            let peer = cfg.tenants.iter().find(|p| p.tier == t.tier).unwrap();
            assert_eq!(
                (t.requests_per_minute, t.requests_burst, t.max_concurrency),
                (
                    peer.requests_per_minute,
                    peer.requests_burst,
                    peer.max_concurrency
                ),
                "{name}/{}",
                t.name
            );
        }
    }
}

#[test]
fn unknown_keys_get_their_tiers_quotas_and_more_engines_copy_the_first_backend() {
    let mut s = levee_sim::scenarios::builtin("steady").unwrap();
    s.tenants[0].api_key = "sk-somebody-new".into();
    s.tenants[0].tier = "free".into();
    let cfg = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(3)).unwrap();
    let added = cfg
        .tenants
        .iter()
        .find(|t| t.key_sha256 == [levee_gateway::hash_key("sk-somebody-new")])
        .unwrap();
    let free = cfg.tenants.iter().find(|t| t.tier == "free").unwrap();
    assert_eq!(added.requests_per_minute, free.requests_per_minute);
    assert_eq!(cfg.models[0].backends.len(), 3);
    // A tier the configuration lacks is an error that says what to do.
    s.tenants[0].tier = "platinum".into();
    let e = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(2)).unwrap_err();
    assert!(
        format!("{e:#}").contains("add it to the configuration"),
        "{e:#}"
    );
}

#[test]
fn the_sweep_sends_the_mix_without_retries_tenants_or_faults() {
    let base = levee_sim::scenarios::builtin("crash-mid-flood").unwrap();
    let s = sweep_scenario(&base, 12.0, 10.0);
    assert!(s.faults.is_empty());
    assert_eq!(s.client.behaviour, Behaviour::None);
    assert_eq!(s.classes, base.classes);
    assert_eq!(s.sessions, base.sessions);
    assert!((s.offered_rps_at(5.0) - 12.0).abs() < 1e-9);
    assert!(estimated_capacity(&base, 2, &drill_engine_config()) > 1.0);
}

#[test]
fn premium_over_quota_counts_only_what_exceeds_the_configured_rate() {
    let mut s = levee_sim::scenarios::builtin("flash-crowd").unwrap();
    s.capacity_rps = 30.0;
    let cfg = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(2)).unwrap();
    // What a client sends on the schedule: first turns at their arrival times.
    let sends = |s: &Scenario| {
        let schedule = levee_sim::arrivals::build(s).unwrap();
        let mut out = std::collections::BTreeMap::<String, Vec<u64>>::new();
        for a in &schedule.arrivals {
            let name = &s.tenants[usize::from(a.tenant)].name;
            out.entry(name.clone())
                .or_default()
                .push(a.at_ns / 1_000_000);
        }
        out
    };
    // Each premium tenant peaks at 0.3x = 9 req/s, under its 15 req/s quota.
    assert_eq!(premium_over_quota(&sends(&s), &s, &cfg), 0);
    // At 10x the capacity, most of their traffic is over quota.
    s.capacity_rps = 300.0;
    let over = premium_over_quota(&sends(&s), &s, &cfg);
    assert!(over > 1000, "{over}");
}

#[test]
fn every_shipped_flood_has_sessions_a_heavy_tail_and_both_stream_kinds() {
    for name in [
        "flash-crowd",
        "noisy-neighbor",
        "heavy-tail",
        "crash-mid-flood",
    ] {
        let s = levee_sim::scenarios::builtin(name).unwrap();
        assert!(s.sessions.share > 0.0, "{name}");
        assert!(s.classes.iter().any(|c| c.stream), "{name}");
        assert!(s.classes.iter().any(|c| !c.stream), "{name}");
        assert!(
            s.classes
                .iter()
                .any(|c| matches!(c.prompt_tokens, levee_sim::dist::Dist::Lognormal { .. })),
            "{name}"
        );
    }
    // heavy-tail: about 10% of requests at >= 3,000 prompt tokens, all within context.
    let s = levee_sim::scenarios::builtin("heavy-tail").unwrap();
    let sched = levee_sim::arrivals::build(&s).unwrap();
    let long = sched
        .arrivals
        .iter()
        .filter(|a| a.prompt_tokens >= 3000)
        .count() as f64;
    let share = long / sched.arrivals.len() as f64;
    assert!((0.08..0.13).contains(&share), "{share}");
    let ctx = drill_engine_config().gpu.max_model_len;
    assert!(sched
        .arrivals
        .iter()
        .all(|a| a.prompt_tokens + a.max_tokens <= ctx));
    // crash-mid-flood crashes an engine while the flood is on.
    let c = levee_sim::scenarios::builtin("crash-mid-flood").unwrap();
    let f = &c.faults[0];
    assert!(c.offered_rps_at(f.at_s) >= 5.0 * c.capacity_rps);
}
