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
    // 12 new conversations a second, each with its expected later turns.
    assert!((s.offered_rps_at(5.0) - 12.0 * base.turns_per_arrival()).abs() < 1e-9);
    assert!(base.turns_per_arrival() > 1.5);
    assert!(estimated_capacity(&base, 2, &drill_engine_config(), 64) > 1.0);
}

#[test]
fn premium_over_quota_counts_only_what_exceeds_the_configured_rate() {
    let mut s = levee_sim::scenarios::builtin("flash-crowd").unwrap();
    s.capacity_rps = stated("C");
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
    // Each premium tenant peaks at 0.3x of the stated capacity, under its 0.5x quota: only
    // the odd burst of the bursty arrivals goes past 2 s of it (2 of 178 first turns).
    let premium_sends: usize = s
        .tenants
        .iter()
        .filter(|t| t.tier == "premium")
        .map(|t| sends(&s).get(&t.name).map_or(0, Vec::len))
        .sum();
    let over = premium_over_quota(&sends(&s), &s, &cfg);
    assert!(
        over * 20 <= premium_sends as u64,
        "{over} of {premium_sends}"
    );
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

/// A number the shipped configuration's comments state, e.g. `# C = 9.8 req/s`.
fn stated(key: &str) -> f64 {
    let prefix = format!("# {key} = ");
    SHIPPED_GATEWAY_CONFIG
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("drill-gateway.toml states no {key}"))
}

#[test]
fn the_shipped_config_follows_its_formula_from_its_stated_capacity() {
    use crate::operator::{contract, watermarks, Basis};
    let basis = Basis {
        capacity_rps: stated("C"),
        ttft_slo_ms: stated("T"),
        e2e_p99_ms: stated("E"),
        model: String::new(),
        measured: String::new(),
    };
    let slots = stated("S") as u32;
    let cfg = levee_gateway::Config::from_toml_str(SHIPPED_GATEWAY_CONFIG).unwrap();
    let e = drill_engine_config();
    assert_eq!(slots, 2 * e.gpu.max_running_seqs);
    let (safe, soft, hard) = watermarks(&basis, slots);
    assert_eq!(
        (cfg.queue.safe, cfg.queue.soft, cfg.queue.hard),
        (safe, soft, hard)
    );
    for (i, tier) in ["premium", "standard", "free"].iter().enumerate() {
        let k = contract(i, &basis, slots);
        let t = &cfg.tiers[*tier];
        assert_eq!(
            (t.queue_wait_ms, t.soft_queue_wait_ms),
            (k.queue_wait_ms, k.soft_queue_wait_ms),
            "{tier}"
        );
        assert_eq!(t.ttft_slo_ms, Some(basis.ttft_slo_ms as u64), "{tier}");
        for tenant in cfg.tenants.iter().filter(|t| t.tier == *tier) {
            assert_eq!(
                (
                    tenant.requests_per_minute,
                    tenant.requests_burst,
                    tenant.max_concurrency
                ),
                (k.requests_per_minute, k.requests_burst, k.max_concurrency),
                "{}",
                tenant.name
            );
        }
    }
    // The drill's calibrated output parses as a configuration and states the same formula.
    let s = levee_sim::scenarios::builtin("noisy-neighbor").unwrap();
    let fleet = crate::operator::Fleet {
        urls: vec![
            "http://127.0.0.1:8001".into(),
            "http://127.0.0.1:8002".into(),
        ],
        kind: "vllm".into(),
        max_in_flight: e.gpu.max_running_seqs,
    };
    let standard = contract(1, &basis, slots);
    let text = crate::operator::calibrated_config(
        &fleet,
        &Basis {
            model: s.request.model.clone(),
            ..basis
        },
        &s,
    );
    let out =
        levee_gateway::Config::from_toml_str(&text).unwrap_or_else(|e| panic!("{e:?}\n{text}"));
    assert_eq!(out.queue.hard, cfg.queue.hard);
    assert!(out
        .tiers
        .values()
        .all(|t| t.ttft_slo_ms == Some(basis.ttft_slo_ms as u64)));
    let noisy = out.tenants.iter().find(|t| t.name == "noisy").unwrap();
    assert_eq!(noisy.requests_per_minute, standard.requests_per_minute);
    assert!(gateway_config(&text, &s, &fleet.urls).is_ok());
}

/// The drill's arguments as `levee drill` parses them.
fn drill_args(args: &[&str]) -> crate::DrillArgs {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        drill: crate::DrillArgs,
    }
    let argv = std::iter::once("drill").chain(args.iter().copied());
    <Cli as clap::Parser>::try_parse_from(argv)
        .expect("the arguments parse")
        .drill
}

#[test]
fn a_compared_configuration_runs_as_one_more_levee_and_is_checked_before_any_run() {
    use crate::contender::Contender;
    let dir = std::env::temp_dir().join(format!("levee-drill-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Without it: no compared levee.
    let plan = crate::Plan::new(drill_args(&["--scenario", "noisy-neighbor"])).unwrap();
    assert!(!plan.contenders.contains(&Contender::LeveeCompare));
    assert!(plan.compare_text.is_none());
    // With it: levee-compare runs last, with that file's text.
    let good = dir.join("good.toml");
    let text = SHIPPED_GATEWAY_CONFIG.replace("[queue]\n", "[queue]\npreempt_over_share = true\n");
    std::fs::write(&good, &text).unwrap();
    let plan = crate::Plan::new(drill_args(&[
        "--scenario",
        "noisy-neighbor",
        "--compare-config",
        good.to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(plan.contenders.last(), Some(&Contender::LeveeCompare));
    assert_eq!(plan.compare_text.as_deref(), Some(text.as_str()));
    assert_eq!(plan.setup().compare_text, Some(text.as_str()));
    // A configuration levee would refuse fails before any run, naming the option.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[queue]\nsafe = \"many\"\n").unwrap();
    let err = crate::Plan::new(drill_args(&[
        "--scenario",
        "noisy-neighbor",
        "--compare-config",
        bad.to_str().unwrap(),
    ]))
    .err()
    .expect("a broken compared configuration is refused");
    assert!(format!("{err:#}").contains("--compare-config"), "{err:#}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_flood_waits_for_its_last_requests_as_long_as_their_client_would() {
    // A contender's flood that stopped watching before its last requests could end would
    // count healthy ones as failures (`cancelled`): the premium verdict, at 99.9%, would
    // miss on the drill's own cut. Whatever the timing (quick or full), the wait after the
    // last scheduled send outlasts the client's timeout, so each request ends by itself.
    for name in levee_sim::scenarios::names() {
        for quick in [false, true] {
            let mut args = vec!["--scenario", name];
            if quick {
                args.push("--quick");
            }
            let plan = crate::Plan::new(drill_args(&args)).unwrap();
            let timeout = plan.scenario.client.timeout_s;
            let waits = plan
                .setup()
                .opts
                .drain
                .map_or(timeout + 1.0, |d| d.as_secs_f64());
            assert!(
                waits > timeout,
                "{name} (quick: {quick}): the flood stops watching {waits} s after its last \
                 send, before its client's timeout ({timeout} s)"
            );
        }
    }
}

#[test]
fn premium_requests_too_long_for_the_engines_are_counted_from_the_schedule() {
    use crate::operator::premium_over_context;
    let ctx = drill_engine_config().gpu.max_model_len;
    let scenario = |prompt: u32, max_tokens: u32| {
        levee_sim::Scenario::from_toml_str(&format!(
            r#"
name = "sizes"
capacity_rps = 10.0
[[phases]]
kind = "steady"
duration_s = 10
rps = "1x"
[[classes]]
name = "c"
prompt_tokens = {{ dist = "constant", value = {prompt} }}
max_tokens = {{ dist = "constant", value = {max_tokens} }}
[[tenants]]
name = "p"
api_key = "sk-p"
share = 0.5
tier = "premium"
[[tenants]]
name = "s"
api_key = "sk-s"
share = 0.5
tier = "standard"
"#
        ))
        .unwrap()
    };
    let premium_sent = |s: &levee_sim::Scenario| {
        let sched = levee_sim::arrivals::build(s).unwrap();
        sched.arrivals.iter().filter(|a| a.tenant == 0).count() as u64
    };
    // Every premium request over the context, the standard ones not counted.
    let long = scenario(ctx - 100, 200);
    assert!(premium_sent(&long) > 10);
    assert_eq!(
        premium_over_context(&long, ctx).unwrap(),
        premium_sent(&long)
    );
    // The prompt alone fits with its max_tokens: none.
    let fits = scenario(ctx - 300, 200);
    assert_eq!(premium_over_context(&fits, ctx).unwrap(), 0);
    // The chat template's tokens count as the engine counts them: one token over is over.
    let template = levee_engine::tokenizer::CHAT_TOKENS_PER_PROMPT
        + levee_engine::tokenizer::CHAT_TOKENS_PER_MESSAGE;
    let edge = scenario(ctx - 200 - template, 200);
    assert_eq!(premium_over_context(&edge, ctx).unwrap(), 0);
    let over = scenario(ctx - 200 - template + 1, 200);
    assert_eq!(
        premium_over_context(&over, ctx).unwrap(),
        premium_sent(&over)
    );
}
