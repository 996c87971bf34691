//! Streams that hold what answers use and grow as their tokens come
//! (`LaneConfig::grow_streams`), with a manual clock: the first hold, growth, refusal, a
//! tenant whose answers run long held to its share, and the engine's cache never holding
//! more than the budget under random streams of two tenants.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use proptest::prelude::*;
use std::sync::Arc;

fn stream(prompt: u64, max_tokens: u64) -> AdmissionRequest<&'static str> {
    stream_of("a", prompt, max_tokens)
}

fn stream_of(tenant: &'static str, prompt: u64, max_tokens: u64) -> AdmissionRequest<&'static str> {
    AdmissionRequest {
        tenant,
        model: "m",
        tier: Tier(0),
        prompt_tokens: prompt,
        completion_tokens: max_tokens,
        max_wait: None,
        session: None,
        answered_at_end: false,
    }
}

/// Model "m" on `backends` backends of 64 slots and `kv` KV tokens each, no headroom,
/// streams growing.
fn admission(backends: usize, kv: u64) -> Admission<u32, &'static str> {
    let mut lane = LaneConfig::new(Watermarks::new(1_000, 2_000, 4_000).unwrap());
    lane.kv_headroom = 0.0;
    lane.grow_streams = true;
    let mut a = Admission::new(AdmissionConfig::new());
    a.set_model(
        "m",
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane,
        },
    );
    let limits = BackendLimits {
        max_in_flight: 64,
        kv_tokens: Some(kv),
    };
    a.set_backends(
        &"m",
        (0..backends)
            .map(|i| (Arc::from(format!("b{i}").as_str()), limits))
            .collect(),
    );
    a
}

fn done(generated: u64) -> Completion {
    Completion {
        outcome: Outcome::Success,
        actual_tokens: None,
        generated: Some(generated),
    }
}

fn dispatched(a: Admit<u32, &'static str>) -> Grant<&'static str> {
    match a {
        Admit::Dispatch(d) => d.grant,
        other => panic!("expected dispatch, got {other:?}"),
    }
}

/// Serves `n` streams whose answers had `tokens` completion tokens each.
fn learn(a: &mut Admission<u32, &'static str>, clock: &ManualClock, n: usize, tokens: u64) {
    for i in 0..n {
        let g = dispatched(a.admit(&stream(10, 500), i as u32, clock.now()));
        a.complete(g, done(tokens), clock.now());
    }
}

fn held(a: &Admission<u32, &'static str>, clock: &ManualClock) -> u64 {
    a.lane(&"m").unwrap().backend_stats(clock.now())[0].tokens_in_flight
}

#[test]
fn a_stream_holds_what_answers_were_seen_to_use_and_grows_ahead_of_its_tokens() {
    let clock = ManualClock::new();
    let mut a = admission(1, 100_000);
    // Before 32 answers were seen, a stream holds its whole budget.
    learn(&mut a, &clock, 31, 100);
    let g = dispatched(a.admit(&stream(10, 2_048), 0, clock.now()));
    assert_eq!((g.kv_tokens(), g.grows_at()), (2_058, None));
    a.complete(g, done(100), clock.now());
    // Now it holds the answers' 99th percentile, and grows 16 tokens before reaching it.
    let mut g = dispatched(a.admit(&stream(10, 2_048), 0, clock.now()));
    assert_eq!((g.kv_tokens(), g.grows_at()), (110, Some(84)));
    assert_eq!(held(&a, &clock), 110);
    assert_eq!(a.grow(&mut g, 83, clock.now()), Ok(Some(84)), "not yet due");
    assert_eq!(g.kv_tokens(), 110);
    // Due: the hold doubles, on the backend too.
    assert_eq!(a.grow(&mut g, 84, clock.now()), Ok(Some(175)));
    assert_eq!((g.kv_tokens(), held(&a, &clock)), (210, 210));
    // Doubling again and again stops at the budget, and then it never grows.
    assert_eq!(a.grow(&mut g, 175, clock.now()), Ok(Some(350)));
    assert_eq!(a.grow(&mut g, 350, clock.now()), Ok(Some(700)));
    assert_eq!(a.grow(&mut g, 700, clock.now()), Ok(Some(1_400)));
    assert_eq!(a.grow(&mut g, 1_400, clock.now()), Ok(None));
    assert_eq!(g.kv_tokens(), 2_058);
    a.complete(g, done(1_500), clock.now());
    assert_eq!(held(&a, &clock), 0, "everything it grew is given back");
    // A request answered at its end, whose tokens levee does not see come, holds all of
    // its budget; so does one whose budget is below what answers use.
    let whole = AdmissionRequest {
        answered_at_end: true,
        ..stream(10, 2_048)
    };
    let g = dispatched(a.admit(&whole, 0, clock.now()));
    assert_eq!((g.kv_tokens(), g.grows_at()), (2_058, None));
    let small = dispatched(a.admit(&stream(10, 50), 0, clock.now()));
    assert_eq!((small.kv_tokens(), small.grows_at()), (60, None));
}

#[test]
fn a_stream_whose_backend_has_no_room_is_refused_its_growth_and_holds_what_it_held() {
    let clock = ManualClock::new();
    let mut a = admission(1, 1_000);
    learn(&mut a, &clock, 32, 100);
    // Eight streams of 10 + 100: 880 of 1,000.
    let mut gs: Vec<_> = (0..8)
        .map(|i| dispatched(a.admit(&stream(10, 500), i, clock.now())))
        .collect();
    assert_eq!(held(&a, &clock), 880);
    // Doubling one fits (100 of the 120 free).
    assert_eq!(a.grow(&mut gs[0], 84, clock.now()), Ok(Some(175)));
    assert_eq!((gs[0].kv_tokens(), held(&a, &clock)), (210, 980));
    // The next one's doubling does not; the least that keeps its lead (17) does.
    assert_eq!(a.grow(&mut gs[1], 84, clock.now()), Ok(Some(101)));
    assert_eq!((gs[1].kv_tokens(), held(&a, &clock)), (127, 997));
    // Then nothing fits: refused, and nothing changed.
    assert_eq!(a.grow(&mut gs[2], 84, clock.now()), Err(OverBudget));
    assert_eq!((gs[2].kv_tokens(), held(&a, &clock)), (110, 997));
    // A client that stopped reading holds its whole budget, or is refused.
    assert_eq!(a.hold_whole(&mut gs[5], clock.now()), Err(OverBudget));
    let cut = gs.remove(2);
    a.complete(cut, done(84), clock.now());
    for g in gs {
        a.complete(g, done(100), clock.now());
    }
    assert_eq!(held(&a, &clock), 0);
    // A stream cut for want of room teaches its tenant its whole budget: its answers may
    // run to their end, so its next stream holds all of it (until eight answers say less).
    let next = dispatched(a.admit(&stream(10, 500), 9, clock.now()));
    assert_eq!(next.kv_tokens(), 510);
    a.complete(next, done(100), clock.now());
}

#[test]
fn a_tenant_whose_answers_run_long_is_admitted_holding_their_length() {
    let clock = ManualClock::new();
    let mut a = admission(1, 100_000);
    learn(&mut a, &clock, 500, 100);
    // Four answers of a tenant run to 1,000 tokens: its next stream holds that from the
    // start (judged by the fair share at admission, never growing past it), where the
    // lane's other tenants still hold the lane's 99th percentile (4 answers in 504 do not
    // move it).
    for i in 0..4 {
        let g = dispatched(a.admit(&stream_of("long", 10, 2_000), i, clock.now()));
        a.complete(g, done(1_000), clock.now());
    }
    let long = dispatched(a.admit(&stream_of("long", 10, 2_000), 4, clock.now()));
    assert_eq!(long.kv_tokens(), 1_010);
    let short = dispatched(a.admit(&stream(10, 2_000), 5, clock.now()));
    assert_eq!(short.kv_tokens(), 110);
    a.complete(long, done(1_000), clock.now());
    a.complete(short, done(100), clock.now());
}

/// Grows `g` as its tokens come, up to `to` tokens: `Err` with the tokens read when a growth
/// was refused.
fn grow_until(
    a: &mut Admission<u32, &'static str>,
    clock: &ManualClock,
    g: &mut Grant<&'static str>,
    to: u64,
) -> Result<u64, u64> {
    while let Some(at) = g.grows_at().filter(|&at| at < to) {
        a.grow(g, at, clock.now()).map_err(|_| at)?;
    }
    Ok(to)
}

#[test]
fn a_tenant_whose_answers_run_long_is_held_to_its_share_and_gives_room_back() {
    let clock = ManualClock::new();
    let mut a = admission(1, 4_000);
    learn(&mut a, &clock, 32, 100);
    // The learning tenant leaves the fair-share window: two tenants share the lane.
    clock.advance(std::time::Duration::from_secs(61));
    // A quiet tenant's stream, then a flooder's twelve, all at the answers' 99th
    // percentile (110 each): 1,430 of 4,000.
    let mut quiet = dispatched(a.admit(&stream_of("quiet", 10, 1_500), 0, clock.now()));
    let mut flood: Vec<_> = (1..=12)
        .map(|i| dispatched(a.admit(&stream_of("flood", 10, 2_000), i, clock.now())))
        .collect();
    // The flooder's answers run to their whole budget: its streams grow until the
    // fair-share rule stops them, well before the backend is full — the quiet tenant's
    // burst headroom stays free.
    let mut refused = 0;
    for g in &mut flood {
        if grow_until(&mut a, &clock, g, 2_000).is_err() {
            refused += 1;
        }
    }
    let flood_held: u64 = flood.iter().map(Grant::kv_tokens).sum();
    assert!(refused > 0, "the flooder's growth was never refused");
    assert!(
        held(&a, &clock) + 500 <= 4_000,
        "the flooder left no room beside it: {} of 4,000 held",
        held(&a, &clock)
    );
    assert!(
        flood_held > 2_000,
        "the flooder took room beyond its share while it could"
    );
    assert!(a.streams_to_cut(&"m").is_empty(), "nobody was cut for it");
    // The quiet tenant's answer runs long too: within its share (2,000), it grows on the
    // room left, then on room the flooder's youngest streams give back.
    assert_eq!(grow_until(&mut a, &clock, &mut quiet, 1_450), Ok(1_450));
    let cut = a.streams_to_cut(&"m");
    assert!(
        !cut.is_empty(),
        "the quiet stream grew without taking room back"
    );
    let named: Vec<usize> = (0..flood.len())
        .filter(|&i| flood[i].stream().is_some_and(|s| cut.contains(&s)))
        .collect();
    assert_eq!(named.len(), cut.len(), "only the flooder's streams are cut");
    assert!(
        named.iter().all(|&i| i >= flood.len() - named.len()),
        "the youngest go first: {named:?}"
    );
    assert!(held(&a, &clock) <= 4_000);
    // A stream whose hold was taken never grows again; its end gives nothing back twice.
    let mut victim = flood.remove(named[0]);
    assert_eq!(a.grow(&mut victim, 10_000, clock.now()), Err(OverBudget));
    a.complete(victim, done(500), clock.now());
    a.complete(quiet, done(1_450), clock.now());
    for g in flood {
        a.complete(g, done(500), clock.now());
    }
    assert_eq!(held(&a, &clock), 0, "every hold is given back once");
}

/// One stream on the simulated engine: its grant, its prompt, the tokens it has generated
/// and the length its answer will have.
struct Running {
    grant: Grant<&'static str>,
    prompt: u64,
    generated: u64,
    length: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Streams of random prompts, budgets and answer lengths, of two tenants, arrive on a
    /// two-backend lane; each engine step every running stream makes up to 16 tokens (the
    /// least lead), which levee reads after the step and grows its hold for, cutting the
    /// stream when its backend has no room, and cutting the streams whose hold went to a
    /// tenant within its share (their connection dropped: the engine stops them before its
    /// next step). After every step, the prompts and the tokens generated on each backend
    /// stay within its budget.
    #[test]
    fn an_engines_cache_never_holds_more_than_its_budget(
        arrivals in prop::collection::vec(
            (1u64..400, 16u64..2_048, 0.0f64..1.0, 0usize..3, any::<bool>()), 20..160),
        steps_per_token in prop::collection::vec(1u64..=16, 1..50),
        learned in 1u64..600,
        kv in 3_000u64..20_000,
    ) {
        let clock = ManualClock::new();
        let mut a = admission(2, kv);
        learn(&mut a, &clock, 32, learned);
        let mut running: Vec<Running> = Vec::new();
        let mut lengths = std::collections::HashMap::new();
        let mut cuts = 0;
        for (step, (prompt, max_tokens, share, arrive, second)) in arrivals.into_iter().enumerate() {
            for i in 0..arrive {
                let id = (step * 3 + i) as u32;
                lengths.insert(id, ((max_tokens as f64 * share) as u64).max(1));
                let tenant = if second { "b" } else { "a" };
                let r = stream_of(tenant, prompt, max_tokens);
                if let Admit::Dispatch(d) = a.admit(&r, id, clock.now()) {
                    let length = lengths[&d.item];
                    running.push(Running { grant: d.grant, prompt, generated: 0, length });
                }
            }
            while let Some(d) = a.dequeue(&"m", clock.now()) {
                let (prompt, length) = (d.grant.prompt_tokens(), lengths[&d.item]);
                running.push(Running { grant: d.grant, prompt, generated: 0, length });
            }
            // The engine's step: every stream makes its tokens, which its cache holds
            // before levee reads them.
            let made = steps_per_token[step % steps_per_token.len()];
            for s in &mut running {
                s.generated = (s.generated + made).min(s.length);
                prop_assert!(
                    s.prompt + s.generated <= s.grant.kv_tokens(),
                    "a stream holds {} and has {} in the cache", s.grant.kv_tokens(),
                    s.prompt + s.generated
                );
            }
            for b in ["b0", "b1"] {
                let used: u64 = running
                    .iter()
                    .filter(|s| s.grant.backend().is_some_and(|id| &**id == b))
                    .map(|s| s.prompt + s.generated)
                    .sum();
                prop_assert!(used <= kv, "backend {} holds {} of {} ({} cut)", b, used, kv, cuts);
            }
            // levee reads them: an answer at its end settles, a hold grows where due, a
            // stream whose backend has no room is cut.
            let mut still = Vec::new();
            for mut s in running.drain(..) {
                if s.generated == s.length {
                    a.complete(s.grant, done(s.generated), clock.now());
                    continue;
                }
                if s.grant.grows_at().is_some_and(|at| s.generated >= at)
                    && a.grow(&mut s.grant, s.generated, clock.now()).is_err()
                {
                    cuts += 1;
                    a.complete(s.grant, done(s.generated), clock.now());
                    continue;
                }
                still.push(s);
            }
            let taken = a.streams_to_cut(&"m");
            for s in still.drain(..) {
                if s.grant.stream().is_some_and(|id| taken.contains(&id)) {
                    cuts += 1;
                    a.complete(s.grant, done(s.generated), clock.now());
                } else {
                    running.push(s);
                }
            }
            clock.advance(std::time::Duration::from_millis(20));
        }
    }
}
