//! The one admission path, with a manual clock: limits, lanes, KV budgets, fair shares,
//! predicted waits, refunds and debt.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use std::sync::Arc;
use std::time::Duration;

const MS: fn(u64) -> Duration = Duration::from_millis;

fn req(tenant: &'static str, tier: u8, prompt: u64) -> AdmissionRequest<&'static str> {
    AdmissionRequest {
        tenant,
        model: "m",
        tier: Tier(tier),
        prompt_tokens: prompt,
        completion_tokens: 0,
        max_wait: None,
        session: None,
        answered_at_end: false,
    }
}

fn on(model: &'static str, r: AdmissionRequest<&'static str>) -> AdmissionRequest<&'static str> {
    AdmissionRequest { model, ..r }
}

fn lane(safe: u64, soft: u64, hard: u64) -> LaneConfig {
    let mut l = LaneConfig::new(Watermarks::new(safe, soft, hard).unwrap());
    l.kv_headroom = 0.0;
    l
}

fn backend(id: &str, slots: usize, kv: Option<u64>) -> (Arc<str>, BackendLimits) {
    (
        Arc::from(id),
        BackendLimits {
            max_in_flight: slots,
            kv_tokens: kv,
        },
    )
}

/// One model "m" with one backend of `slots` slots and KV budget `kv`.
fn admission(slots: usize, kv: Option<u64>, lane_cfg: LaneConfig) -> Admission<u32, &'static str> {
    let mut a = Admission::new(AdmissionConfig::new());
    a.set_model(
        "m",
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane: lane_cfg,
        },
    );
    a.set_backends(&"m", vec![backend("b0", slots, kv)]);
    a
}

/// Like [`admission`], with `limits` for every tenant and a roomy lane.
fn limited(limits: LimitSpec, slots: usize) -> Admission<u32, &'static str> {
    let mut cfg = AdmissionConfig::new();
    cfg.tenant_default = limits;
    let mut a = Admission::new(cfg);
    a.set_model(
        "m",
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane: lane(100, 200, 300),
        },
    );
    a.set_backends(&"m", vec![backend("b0", slots, None)]);
    a
}

fn ok() -> Completion {
    Completion {
        outcome: Outcome::Success,
        actual_tokens: None,
        generated: None,
    }
}

fn dispatched<T: std::fmt::Debug, K: std::fmt::Debug>(a: Admit<T, K>) -> Dispatched<T, K> {
    match a {
        Admit::Dispatch(d) => d,
        other => panic!("expected dispatch, got {other:?}"),
    }
}

fn refusal<T: std::fmt::Debug, K: std::fmt::Debug>(a: Admit<T, K>) -> Refusal<T> {
    match a {
        Admit::Refused(r) => r,
        other => panic!("expected refusal, got {other:?}"),
    }
}

fn queued<T: std::fmt::Debug, K: std::fmt::Debug>(a: Admit<T, K>) -> Ticket {
    match a {
        Admit::Queued { ticket, .. } => ticket,
        other => panic!("expected queued, got {other:?}"),
    }
}

/// Serves `n` requests of `tenant` in `tier` at once, each held `held`: the lane measures
/// that service time.
fn serve(
    a: &mut Admission<u32, &'static str>,
    clock: &ManualClock,
    tenant: &'static str,
    tier: u8,
    n: u32,
    held: Duration,
) {
    let running: Vec<_> = (0..n)
        .map(|i| dispatched(a.admit(&req(tenant, tier, 10), i, clock.now())))
        .collect();
    clock.advance(held);
    for d in running {
        a.complete(d.grant, ok(), clock.now());
    }
}

#[test]
fn dispatch_then_queue_then_refuse_at_hard() {
    let clock = ManualClock::new();
    let mut a = admission(2, None, lane(2, 4, 6));
    let d1 = dispatched(a.admit(&req("a", 0, 10), 1, clock.now()));
    let _d2 = dispatched(a.admit(&req("a", 0, 10), 2, clock.now()));
    // Slots full: queue (load 2 = safe).
    let Admit::Queued {
        decision,
        deadline,
        position,
        ..
    } = a.admit(&req("b", 0, 10), 3, clock.now())
    else {
        panic!("expected queued")
    };
    assert_eq!(decision.zone, LoadZone::SafeToSoft);
    assert_eq!(deadline, clock.now() + Duration::from_secs(30));
    assert_eq!(position, 1);
    for i in 4..6 {
        queued(a.admit(&req("b", 0, 10), i, clock.now()));
    }
    // Load 5: between soft (4) and hard (6); tier 2 may not wait there.
    let r = refusal(a.admit(&req("c", 2, 10), 9, clock.now()));
    assert_eq!(r.reason, RefusalReason::Watermark(LoadZone::SoftToHard));
    assert_eq!(r.reason.code(), "capacity_overload");
    queued(a.admit(&req("b", 0, 10), 6, clock.now()));
    let r = refusal(a.admit(&req("b", 0, 10), 7, clock.now()));
    assert_eq!(r.reason, RefusalReason::Watermark(LoadZone::AtHard));
    // A slot frees: the oldest queued of the highest tier goes next.
    clock.advance(MS(100));
    assert!(a.dequeue(&"m", clock.now()).is_none(), "no slot yet");
    a.complete(d1.grant, ok(), clock.now());
    let next = a.dequeue(&"m", clock.now()).unwrap();
    assert_eq!(next.item, 3);
    assert_eq!(next.waited, MS(100));
    assert_eq!(next.grant.backend().map(|b| &**b), Some("b0"));
}

#[test]
fn new_request_does_not_overtake_equal_priority_queue_but_higher_tier_does() {
    let clock = ManualClock::new();
    let mut a = admission(1, None, lane(10, 20, 30));
    let d = dispatched(a.admit(&req("a", 1, 1), 1, clock.now()));
    queued(a.admit(&req("a", 1, 1), 2, clock.now()));
    a.complete(d.grant, ok(), clock.now());
    // The slot is free but item 2 has not been dequeued yet: same tier queues behind it.
    queued(a.admit(&req("b", 1, 1), 3, clock.now()));
    // A higher tier goes first.
    let vip = dispatched(a.admit(&req("vip", 0, 1), 4, clock.now()));
    a.complete(vip.grant, ok(), clock.now());
    // Between the two queued, fairness decides: a was already served once, b not at all.
    assert_eq!(a.dequeue(&"m", clock.now()).unwrap().item, 3);
}

#[test]
fn the_kv_budget_gates_dispatch_not_only_the_request_cap() {
    let clock = ManualClock::new();
    // 10 request slots but 1,000 KV tokens: two 400-token requests fit, a third waits.
    let mut a = admission(10, Some(1_000), lane(100, 200, 300));
    let d1 = dispatched(a.admit(&req("a", 0, 400), 1, clock.now()));
    let _d2 = dispatched(a.admit(&req("b", 0, 400), 2, clock.now()));
    queued(a.admit(&req("c", 0, 400), 3, clock.now()));
    assert!(a.dequeue(&"m", clock.now()).is_none());
    let st = &a.lane(&"m").unwrap().backend_stats(clock.now())[0];
    assert_eq!((st.in_flight, st.tokens_in_flight), (2, 800));
    a.complete(d1.grant, ok(), clock.now());
    assert_eq!(a.dequeue(&"m", clock.now()).unwrap().item, 3);
    // Larger than the whole budget: refused at once, not queued forever.
    let r = refusal(a.admit(&req("d", 0, 1_001), 4, clock.now()));
    assert_eq!(r.reason, RefusalReason::ExceedsKvBudget);
    assert_eq!(r.reason.code(), "context_length_exceeded");
    assert!(r.retry_after.is_none());
}

#[test]
fn a_learned_budget_and_the_engines_report_correct_the_count() {
    let clock = ManualClock::new();
    let mut a = admission(10, None, lane(100, 200, 300));
    // Budget unknown: only the request cap applies.
    let d = dispatched(a.admit(&req("a", 0, 5_000), 1, clock.now()));
    // Learned from the engine: 6,000 tokens.
    a.set_backend_limits(
        &"m",
        "b0",
        BackendLimits {
            max_in_flight: 10,
            kv_tokens: Some(6_000),
        },
    );
    queued(a.admit(&req("b", 0, 2_000), 2, clock.now()));
    a.complete(d.grant, ok(), clock.now());
    let d = a.dequeue(&"m", clock.now()).unwrap();
    // The engine says 90% of its cache is in use although levee counts 2,000 tokens: the
    // larger figure counts while the report is fresh.
    let report = BackendReport {
        running: 1.0,
        waiting: 0.0,
        kv_usage: Some(0.9),
    };
    a.report(&"m", "b0", report, clock.now());
    queued(a.admit(&req("c", 0, 1_000), 3, clock.now()));
    assert!(a.dequeue(&"m", clock.now()).is_none());
    // A stale report is not trusted.
    clock.advance(Duration::from_secs(4));
    assert_eq!(a.dequeue(&"m", clock.now()).unwrap().item, 3);
    // An engine that reports its own queue gets no more than it runs.
    a.report(
        &"m",
        "b0",
        BackendReport {
            running: 2.0,
            waiting: 3.0,
            kv_usage: None,
        },
        clock.now(),
    );
    queued(a.admit(&req("e", 0, 10), 4, clock.now()));
    assert!(a.dequeue(&"m", clock.now()).is_none());
    drop(d);
}

#[test]
fn on_a_fleet_the_engines_report_counts_less_what_the_others_hold() {
    let clock = ManualClock::new();
    // This replica's slice: 4 slots and 1,000 of the engine's 10,000 KV tokens.
    let mut a = admission(4, Some(1_000), lane(100, 200, 300));
    let fleet = |a: &mut Admission<u32, &'static str>, slots: u64, kv_tokens: u64| {
        let others = Budget { slots, kv_tokens };
        a.lane_admission(&"m")
            .unwrap()
            .lane_mut()
            .set_backend_fleet(
                "b0",
                Some(FleetView {
                    others,
                    engine_kv: Some(10_000),
                    replicas: 2,
                }),
            );
    };
    let kv = |a: &mut Admission<u32, &'static str>, used: f64, running: f64, waiting: f64| {
        let r = BackendReport {
            running,
            waiting,
            kv_usage: Some(used),
        };
        a.report(&"m", "b0", r, clock.now());
    };
    // The engine has 85% of its cache in use (8,500 tokens) and the others hold 8,000: this
    // replica's part is at least 500, so 400 more fit its slice (read against the slice
    // alone, 85% of it would leave room for 150 only).
    fleet(&mut a, 6, 8_000);
    kv(&mut a, 0.85, 6.0, 0.0);
    let d = dispatched(a.admit(&req("a", 0, 400), 1, clock.now()));
    // The others gave most of theirs back but the engine still reports 8,500: at least
    // 6,500 are this replica's — its slice is full whatever levee counts.
    fleet(&mut a, 6, 2_000);
    let t = queued(a.admit(&req("b", 0, 100), 2, clock.now()));
    assert!(a.dequeue(&"m", clock.now()).is_none());
    a.cancel(&"m", t, clock.now());
    // The engine has requests waiting while it runs 6, of which the others hold 5: this
    // replica runs at most one (it has one).
    fleet(&mut a, 5, 0);
    kv(&mut a, 0.0, 6.0, 2.0);
    queued(a.admit(&req("c", 0, 10), 3, clock.now()));
    assert!(a.dequeue(&"m", clock.now()).is_none());
    // The others hold 2: up to 4.
    fleet(&mut a, 2, 0);
    assert_eq!(a.dequeue(&"m", clock.now()).unwrap().item, 3);
    drop(d);
}

/// Two replicas share one backend of 8 slots, each running 4 standard requests in its
/// slice of 4; A has standard requests waiting, B premium ones. Split by the replicas'
/// totals, each kept 4 and B's premium waited for B's own releases; split by tier, B's
/// premium want comes first: B's slice grows past what it runs (its premium goes as soon
/// as the room A holds is back), A's shrinks below it (A admits nothing more).
#[test]
fn a_fleet_split_by_tier_gives_premium_waiting_on_one_replica_the_room_first() {
    let clock = ManualClock::new();
    let now = clock.now();
    let budget = Budget {
        slots: 8,
        kv_tokens: 8_000,
    };
    let mut a = admission(4, Some(4_000), lane(100, 200, 300));
    let mut b = admission(4, Some(4_000), lane(100, 200, 300));
    let mut running = Vec::new();
    for i in 0..4 {
        running.push(dispatched(a.admit(&req("s", 1, 1_000), i, now)));
        running.push(dispatched(b.admit(&req("t", 1, 1_000), 10 + i, now)));
    }
    for i in 0..4 {
        queued(a.admit(&req("s", 1, 1_000), 20 + i, now));
    }
    for i in 0..2 {
        queued(b.admit(&req("p", 0, 1_000), 30 + i, now));
    }
    let demand = |x: &mut Admission<u32, &'static str>| {
        x.lane_admission(&"m").unwrap().lane().fleet_demand("b0")
    };
    let (da, db) = (demand(&mut a), demand(&mut b));
    assert_eq!(
        db[0],
        SliceDemand {
            in_flight: 0,
            kv_in_flight: 0,
            queued: 2,
            queued_kv: 2_000
        }
    );
    assert_eq!(
        da[1],
        SliceDemand {
            in_flight: 4,
            kv_in_flight: 4_000,
            queued: 4,
            queued_kv: 4_000
        }
    );
    let slots =
        |d: &[SliceDemand]| -> Vec<u64> { slice_want(budget, d).iter().map(|w| w.slots).collect() };
    // A: standard 4 running + 4 queued + a margin of 2, cut to the budget. B: premium 2
    // queued + the margin's shortfall of 1; standard 4 running + 1.
    assert_eq!(&slots(&da)[..2], &[0, 8]);
    assert_eq!(&slots(&db)[..2], &[3, 5]);
    let totals = |d: &[SliceDemand]| slots(d).iter().sum::<u64>();
    assert_eq!(fair_split(&[totals(&da), totals(&db)], 8), vec![4, 4]);
    let split = tiered_split(&[slots(&da), slots(&db)], 8);
    assert_eq!(split, vec![3, 5]);
    let slice = |x: &mut Admission<u32, &'static str>, slots: u64| {
        x.lane_admission(&"m")
            .unwrap()
            .lane_mut()
            .set_backend_limits(
                "b0",
                BackendLimits {
                    max_in_flight: slots as usize,
                    kv_tokens: Some(slots * 1_000),
                },
            );
    };
    slice(&mut a, split[0]);
    slice(&mut b, split[1]);
    // B's premium goes first; A, over its slice, waits even after one of its own ends.
    assert_eq!(b.dequeue(&"m", now).unwrap().item, 30);
    let first = running.remove(0);
    a.complete(first.grant, ok(), now);
    assert!(a.dequeue(&"m", now).is_none());
    for d in running {
        let m = if d.item < 10 { &mut a } else { &mut b };
        m.complete(d.grant, ok(), now);
    }
}

/// On a fleet, a replica's queue is its part of the fleet's, which the fleet drains as one:
/// the wait is the shorter of its own part at its own rate and the fleet's queue (`R·n`
/// places) at the fleet's rate. When the replicas run equal parts, the mean wait is the
/// one-replica figure and its 95th percentile nearer the mean; when this replica's own part
/// is small for the moment, the wait does not lengthen with it; when it runs more than its
/// part, its own rate counts.
#[test]
fn on_a_fleet_the_predicted_wait_is_taken_over_the_fleets_queue() {
    let clock = ManualClock::new();
    let mut a = admission(4, None, lane(100, 200, 300));
    // A service time of 1 s; nothing in flight now: the lane serves 1 request a second.
    serve(&mut a, &clock, "s", 0, 1, Duration::from_secs(1));
    let wait = |a: &mut Admission<u32, &'static str>| {
        let l = a.lane_admission(&"m").unwrap().lane();
        l.predict_wait(Tier(0), &"p", clock.now()).1.unwrap()
    };
    let fleet = |a: &mut Admission<u32, &'static str>, replicas: u32, others: u64| {
        a.lane_admission(&"m")
            .unwrap()
            .lane_mut()
            .set_backend_fleet(
                "b0",
                Some(FleetView {
                    others: Budget {
                        slots: others,
                        kv_tokens: 0,
                    },
                    engine_kv: None,
                    replicas,
                }),
            );
    };
    // Alone: place 1 at (1 + 1.65) / 1 s.
    assert_eq!(wait(&mut a), Duration::from_secs_f64(2.65));
    // Nine replicas, the eight others holding one slot each as this one does: place 1 is
    // about 9th of the fleet's queue, drained at 9 a second: (9 + 1.65·3) / 9 s.
    fleet(&mut a, 9, 8);
    assert_eq!(
        wait(&mut a),
        Duration::from_secs_f64((9.0 + 1.65 * 3.0) / 9.0)
    );
    // Three replicas, the two others holding 8 slots while this one runs 1 (its slice
    // shrank): the fleet drains 9 a second, place 1 is about 3rd: (3 + 1.65·√3) / 9 s,
    // where this replica's part at its own rate would predict (1 + 1.65·√(1/9)) / 1 s.
    fleet(&mut a, 3, 8);
    let w = wait(&mut a).as_secs_f64();
    assert!((w - (3.0 + 1.65 * 3f64.sqrt()) / 9.0).abs() < 1e-9, "{w}");
    // Two replicas, the other holding nothing (this one runs the fleet's whole part): its
    // own part at its own rate, (1 + 1.65) / 1 s, where the fleet's queue read as twice
    // this one's would predict (2 + 1.65·√2) / 1 s.
    fleet(&mut a, 2, 0);
    assert_eq!(wait(&mut a), Duration::from_secs_f64(2.65));
}

#[test]
fn rate_refusals_say_when_and_charge_nothing() {
    let clock = ManualClock::starting_at(Timestamp::from_nanos(1));
    let mut a = limited(
        LimitSpec {
            requests_per_minute: Some(60),
            request_burst: Some(1),
            tokens_per_minute: Some(1_000),
            ..LimitSpec::UNLIMITED
        },
        10,
    );
    // Too many tokens: refused, and the request charge was not taken.
    let r = refusal(a.admit(&req("a", 0, 1_500), 1, clock.now()));
    assert_eq!(r.reason, RefusalReason::TooLarge(Scope::Tenant));
    let d = dispatched(a.admit(&req("a", 0, 100), 2, clock.now()));
    let r = refusal(a.admit(&req("a", 0, 100), 3, clock.now()));
    assert_eq!(r.reason, RefusalReason::RequestRate(Scope::Tenant));
    assert_eq!(r.retry_after.unwrap().as_duration(), Duration::from_secs(1));
    a.complete(d.grant, ok(), clock.now());
}

#[test]
fn refusals_after_admission_give_request_and_token_charges_back() {
    let clock = ManualClock::starting_at(Timestamp::from_nanos(1));
    let mut a = limited(
        LimitSpec {
            requests_per_minute: Some(2),
            request_burst: Some(2),
            tokens_per_minute: Some(1_000),
            ..LimitSpec::UNLIMITED
        },
        1,
    );
    let d = dispatched(a.admit(&req("a", 0, 400), 1, clock.now()));
    queued(a.admit(&req("a", 0, 400), 2, clock.now()));
    // Both request slots of the minute and 800 tokens are taken.
    assert_eq!(
        refusal(a.admit(&req("a", 0, 10), 3, clock.now())).reason,
        RefusalReason::RequestRate(Scope::Tenant)
    );
    // The queued one times out: its request and its tokens come back.
    clock.advance(Duration::from_secs(31));
    let gone = a.expire(&"m", clock.now());
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].reason, RefusalReason::QueueTimeout);
    let h = a.rate_limit_headers(&"a", clock.now());
    assert!(h.tokens.unwrap().remaining >= 600, "{h:?}");
    // The one in flight fails before reaching the backend: refunded too.
    a.refund(d.grant, clock.now());
    let d = dispatched(a.admit(&req("a", 0, 900), 4, clock.now()));
    a.complete(d.grant, ok(), clock.now());
}

#[test]
fn token_debt_makes_an_overspending_tenant_wait() {
    let clock = ManualClock::starting_at(Timestamp::from_nanos(1));
    let mut a = limited(
        LimitSpec {
            tokens_per_minute: Some(6_000),
            ..LimitSpec::UNLIMITED
        },
        10,
    );
    // Declared 100 tokens, used 9,000: 3,000 past empty is carried as debt.
    let d = dispatched(a.admit(&req("a", 0, 100), 1, clock.now()));
    let done = Completion {
        outcome: Outcome::Success,
        actual_tokens: Some(9_000),
        generated: None,
    };
    a.complete(d.grant, done, clock.now());
    let r = refusal(a.admit(&req("a", 0, 100), 2, clock.now()));
    assert_eq!(r.reason, RefusalReason::TokenRate(Scope::Tenant));
    // Paying back 3,000 + 100 tokens at 100/s takes 31 s.
    let wait = r.retry_after.unwrap().as_duration();
    assert!(wait >= Duration::from_secs(30), "{wait:?}");
    clock.advance(wait);
    dispatched(a.admit(&req("a", 0, 100), 3, clock.now()));
}

#[test]
fn a_flood_on_one_model_does_not_refuse_another() {
    let clock = ManualClock::new();
    let mut a = Admission::new(AdmissionConfig::new());
    for m in ["a", "b"] {
        a.set_model(
            m,
            ModelSpec {
                limits: LimitSpec::UNLIMITED,
                lane: lane(2, 4, 6),
            },
        );
        a.set_backends(&m, vec![backend(m, 2, None)]);
    }
    // Model a at its hard mark.
    let mut refused = 0;
    for i in 0..20 {
        if let Admit::Refused(_) = a.admit(&on("a", req("f", 1, 10)), i, clock.now()) {
            refused += 1;
        }
    }
    assert_eq!(refused, 14);
    // Model b is untouched.
    dispatched(a.admit(&on("b", req("q", 1, 10)), 100, clock.now()));
}

#[test]
fn a_same_tier_flooder_is_held_to_its_share_while_others_are_active() {
    let clock = ManualClock::new();
    let mut a = admission(10, None, lane(100, 200, 300));
    let mut flooder = Vec::new();
    for i in 0..10 {
        flooder.push(dispatched(a.admit(&req("f", 1, 10), i, clock.now())));
    }
    for i in 10..20 {
        queued(a.admit(&req("f", 1, 10), i, clock.now()));
    }
    // A quiet tenant of the same tier arrives and waits.
    queued(a.admit(&req("q", 1, 10), 100, clock.now()));
    // Slots free: the quiet tenant goes first. The flooder, past its share (5 of 10) with a
    // backlog, gets no slot back: the 2 free slots are the burst headroom the quiet tenant
    // keeps (⌈3·√(1 + 1)⌉ = 5, capped by nothing it could not use).
    for _ in 0..3 {
        let g = flooder.pop().unwrap();
        a.complete(g.grant, ok(), clock.now());
    }
    let first = a.dequeue(&"m", clock.now()).unwrap();
    assert_eq!(first.item, 100);
    let mut got = Vec::new();
    while let Some(d) = a.dequeue(&"m", clock.now()) {
        got.push(d.item);
    }
    assert_eq!(got, Vec::<u32>::new());
    // Once the quiet tenant has been idle for the window, the flooder takes everything.
    a.complete(first.grant, ok(), clock.now());
    clock.advance(Duration::from_secs(61));
    drop(a.expire(&"m", clock.now()));
    for i in 30..33 {
        dispatched(a.admit(&req("f", 1, 10), i, clock.now()));
    }
}

#[test]
fn a_full_lane_gives_a_place_to_the_tenant_with_less_waiting() {
    let clock = ManualClock::new();
    // Hard watermark at 4: one slot, three places in the queue.
    let mut a = admission(1, None, lane(2, 3, 4));
    let _running = dispatched(a.admit(&req("f", 0, 10), 1, clock.now()));
    for i in 2..5 {
        queued(a.admit(&req("f", 0, 10), i, clock.now()));
    }
    // Full for the flooder itself: nothing to displace from a shorter backlog.
    let r = refusal(a.admit(&req("f", 0, 10), 5, clock.now()));
    assert_eq!(r.reason, RefusalReason::Watermark(LoadZone::AtHard));
    // A peer with nothing waiting takes the place of the flooder's newest entry.
    queued(a.admit(&req("q", 0, 10), 100, clock.now()));
    let gone = a.expire(&"m", clock.now());
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].item, 4);
    assert_eq!(gone[0].reason, RefusalReason::Displaced);
    assert_eq!(gone[0].reason.code(), "capacity_overload");
    // The flooder keeps its other places; a lower tier displaces nobody in tier 0.
    let r = refusal(a.admit(&req("l", 1, 10), 200, clock.now()));
    assert_eq!(r.reason, RefusalReason::Watermark(LoadZone::AtHard));
    assert!(a.expire(&"m", clock.now()).is_empty());
}

#[test]
fn a_full_queue_gives_a_higher_tier_the_place_of_the_lowest_one_waiting() {
    let clock = ManualClock::new();
    // One slot; three places in the queue, well below every watermark.
    let mut cfg = lane(10, 20, 30);
    cfg.queue_max_len = 3;
    let mut a = admission(1, None, cfg);
    let _running = dispatched(a.admit(&req("l", 2, 10), 1, clock.now()));
    queued(a.admit(&req("l", 2, 10), 2, clock.now()));
    queued(a.admit(&req("l", 2, 10), 3, clock.now()));
    queued(a.admit(&req("s", 1, 10), 10, clock.now()));
    // Full: the lowest tier's own flooder finds no one below it (or shorter) to displace.
    let r = refusal(a.admit(&req("l", 2, 10), 4, clock.now()));
    assert_eq!(r.reason, RefusalReason::QueueFull(PushRefusal::QueueFull));
    // Premium takes the places of the lowest tier's newest entries first, then tier 1's.
    queued(a.admit(&req("p", 0, 10), 100, clock.now()));
    queued(a.admit(&req("p", 0, 10), 101, clock.now()));
    let gone: Vec<u32> = a
        .expire(&"m", clock.now())
        .into_iter()
        .map(|e| e.item)
        .collect();
    assert_eq!(gone, vec![3, 2]);
    queued(a.admit(&req("p", 0, 10), 102, clock.now()));
    let gone = a.expire(&"m", clock.now());
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].item, 10);
    assert_eq!(gone[0].reason, RefusalReason::Displaced);
    // Only premium waits now; its own tenant displaces nobody.
    let r = refusal(a.admit(&req("p", 0, 10), 103, clock.now()));
    assert_eq!(r.reason, RefusalReason::QueueFull(PushRefusal::QueueFull));
    assert!(a.expire(&"m", clock.now()).is_empty());
}

type Premium = Vec<Dispatched<u32, &'static str>>;

/// Eight slots, a service time of 4 s that tier 1 measured alone (taking every slot while
/// no higher tier sends), then premium sending about one request a second for 4 s and
/// holding its slots; `cfg` is the lane's.
fn premium_holds_four_of_eight(
    cfg: LaneConfig,
) -> (Admission<u32, &'static str>, ManualClock, Premium) {
    let clock = ManualClock::new();
    let mut a = admission(8, None, cfg);
    serve(&mut a, &clock, "x", 1, 1, Duration::from_secs(4));
    serve(&mut a, &clock, "a", 1, 8, Duration::from_secs(4));
    let mut premium = Vec::new();
    for i in 0..4 {
        premium.push(dispatched(a.admit(&req("p", 0, 10), 100 + i, clock.now())));
        clock.advance(MS(1000));
    }
    (a, clock, premium)
}

#[test]
fn lower_tiers_keep_slots_free_for_a_higher_tier_that_is_sending() {
    let (mut a, clock, mut premium) = premium_holds_four_of_eight(lane(100, 200, 300));
    // Tier 1 now stops short of the last free slot: what premium is expected to bring in
    // before the next release (0.5/s measured × 4 s ÷ 8 in flight, plus a standard
    // deviation: one slot; two while fewer are in flight and releases come slower).
    let mut taken = Vec::new();
    let mut waiting = 0;
    for i in 0..4 {
        match a.admit(&req("a", 1, 10), 10 + i, clock.now()) {
            Admit::Dispatch(d) => taken.push(d),
            Admit::Queued { .. } => waiting += 1,
            Admit::Refused(r) => panic!("refused: {r:?}"),
        }
    }
    assert_eq!(
        (taken.len(), waiting),
        (3, 1),
        "tier 1 leaves one of 4 free slots"
    );
    // The next premium request finds it at once; the one after waits ahead of tier 1.
    premium.push(dispatched(a.admit(&req("p", 0, 10), 200, clock.now())));
    queued(a.admit(&req("p", 0, 10), 201, clock.now()));
    // Premium falls silent: its intake decays and tier 1 may take every slot again.
    clock.advance(Duration::from_secs(60));
    for d in premium.into_iter().chain(taken) {
        a.complete(d.grant, ok(), clock.now());
    }
    assert_eq!(a.expire(&"m", clock.now()).len(), 2);
    for i in 0..8 {
        dispatched(a.admit(&req("a", 1, 10), 20 + i, clock.now()));
    }
}

/// Tier 1's requests taken at once and queued when premium (1/s, 4 s each) holds 4 of 8
/// slots, with premium's time to first token objective `objective`.
fn tier_one_beside_premium(objective: Option<Duration>) -> (usize, usize) {
    let mut cfg = lane(100, 200, 300);
    cfg.slo = vec![
        LatencySlo {
            ttft: objective,
            tpot: None,
        },
        LatencySlo::default(),
    ];
    let (mut a, clock, _premium) = premium_holds_four_of_eight(cfg);
    let (mut taken, mut waiting) = (0, 0);
    for i in 0..4 {
        match a.admit(&req("a", 1, 10), 10 + i, clock.now()) {
            Admit::Dispatch(_) => taken += 1,
            Admit::Queued { .. } => waiting += 1,
            Admit::Refused(r) => panic!("refused: {r:?}"),
        }
    }
    (taken, waiting)
}

#[test]
fn no_slot_idles_for_a_higher_tier_that_releases_place_within_its_objective() {
    // The slot kept for premium's expected burst would be replaced by the next release
    // 0.5–0.8 s later (4 s ÷ 5 to 8 in flight): within a quarter of a 60 s objective, so
    // tier 1 takes every free slot and premium waits for releases, ahead of tier 1.
    assert_eq!(
        tier_one_beside_premium(Some(Duration::from_secs(60))),
        (4, 0)
    );
    // Past a quarter of a 1 s objective (the last free slot's gap is 0.5 s), or with no
    // objective to judge by: kept.
    assert_eq!(
        tier_one_beside_premium(Some(Duration::from_secs(1))),
        (3, 1)
    );
    assert_eq!(tier_one_beside_premium(None), (3, 1));
}

#[test]
fn a_background_request_goes_only_to_a_backend_with_no_recent_dispatch() {
    let clock = ManualClock::new();
    let mut cfg = lane(100, 200, 300);
    cfg.isolated_tier = Some(Tier(2));
    let mut a = admission(8, None, cfg);
    a.set_backends(&"m", vec![backend("b0", 8, None), backend("b1", 8, None)]);
    a.set_prefill_window(&"m", MS(200));
    // A chat request on each backend: both may still be waiting for a prefill step.
    let c0 = dispatched(a.admit(&req("chat", 1, 10), 1, clock.now()));
    let c1 = dispatched(a.admit(&req("chat", 1, 10), 2, clock.now()));
    assert_ne!(c0.grant.backend(), c1.grant.backend());
    clock.advance(MS(50));
    queued(a.admit(&req("batch", 2, 1000), 3, clock.now()));
    // It waits out the prefill window, with the dispatcher told when that ends.
    assert_eq!(
        a.next_deadline(&"m", clock.now()),
        Some(Timestamp::ZERO + MS(200))
    );
    clock.advance(MS(100));
    assert!(a.dequeue(&"m", clock.now()).is_none());
    clock.advance(MS(50));
    let task = a.dequeue(&"m", clock.now()).expect("window over");
    // A chat request now goes to one backend; the next background request to the other.
    clock.advance(MS(500));
    let c2 = dispatched(a.admit(&req("chat", 1, 10), 4, clock.now()));
    let t2 = dispatched(a.admit(&req("batch", 2, 1000), 5, clock.now()));
    assert_ne!(c2.grant.backend(), t2.grant.backend());
    // A tier that is not the isolated one is not held back.
    dispatched(a.admit(&req("chat", 1, 10), 6, clock.now()));
    drop((c0, c1, task));
}

#[test]
fn on_a_busy_backend_a_background_request_waits_for_a_longer_gap_than_usual_not_the_window() {
    let clock = ManualClock::new();
    let mut cfg = lane(1000, 2000, 3000);
    cfg.isolated_tier = Some(Tier(2));
    let mut a = admission(1000, None, cfg);
    // A window of 1 s, on a backend that takes a request every 50 ms: a quiet second would
    // almost never come.
    a.set_prefill_window(&"m", Duration::from_secs(1));
    // Requests hold the backend 10 s: by the queue model, the higher tier's arrivals (20/s)
    // take every release (100 in flight ÷ 10 s), and a queued request would wait for ever.
    serve(&mut a, &clock, "chat", 1, 1, Duration::from_secs(10));
    let mut held = Vec::new();
    for i in 0..100 {
        held.push(dispatched(a.admit(&req("chat", 1, 10), i, clock.now())));
        clock.advance(MS(50));
    }
    // The background request is not refused for that: it waits only for a quiet moment.
    queued(a.admit(&req("batch", 2, 1000), 1000, clock.now()));
    // It waits until the backend has been quiet for longer than its mean gap between
    // dispatches (under 100 ms at this rate), not for a whole second.
    let next = a.next_deadline(&"m", clock.now()).expect("a wake-up");
    let wait = next.saturating_duration_since(clock.now());
    assert!(wait > Duration::ZERO && wait < MS(100), "{wait:?}");
    assert!(a.dequeue(&"m", clock.now()).is_none());
    clock.advance(wait);
    assert!(a.dequeue(&"m", clock.now()).is_some());
    drop(held);
}

#[test]
fn a_fenced_backend_is_passed_over_for_one_capped_only_by_its_reported_queue() {
    let clock = ManualClock::new();
    let mut a = admission(8, None, lane(100, 200, 300));
    a.set_backends(&"m", vec![backend("b0", 8, None), backend("b1", 8, None)]);
    let r0 = dispatched(a.admit(&req("x", 0, 10), 1, clock.now()));
    let r1 = dispatched(a.admit(&req("x", 0, 10), 2, clock.now()));
    let (fenced, queued_at) = (r0.grant.backend().unwrap(), r1.grant.backend().unwrap());
    // One engine reports a queue (capped at what it runs, which levee already sends); the
    // other is prefilling a long batch prompt.
    let queue = BackendReport {
        running: 1.0,
        waiting: 1.0,
        kv_usage: None,
    };
    a.report(&"m", queued_at, queue, clock.now());
    a.fence_backend(&"m", fenced, clock.now() + MS(300));
    // The queued engine takes the next step; the fenced one would hold it for the prefill.
    let d = dispatched(a.admit(&req("x", 0, 10), 3, clock.now()));
    assert_eq!(d.grant.backend(), Some(queued_at));
    // Without a fence the reported queue's cap holds again.
    clock.advance(MS(400));
    let e = dispatched(a.admit(&req("x", 0, 10), 4, clock.now()));
    assert_eq!(e.grant.backend(), Some(fenced));
}

#[test]
fn a_request_that_would_wait_past_its_budget_is_refused_at_once() {
    let clock = ManualClock::new();
    let mut a = admission(2, None, lane(100, 200, 300));
    // Measure a service time of 1 s.
    serve(&mut a, &clock, "a", 1, 2, Duration::from_secs(1));
    let mut held = Vec::new();
    for i in 0..2 {
        held.push(dispatched(a.admit(&req("a", 1, 10), i, clock.now())));
    }
    // Tier 1 may wait 15 s; with 2 in flight at 1 s each, position p waits p / 2 s on
    // average and (p + 1.65·√p) / 2 s at the 95th percentile, which is what must fit.
    let mut positions = Vec::new();
    let refused = loop {
        match a.admit(&req("a", 1, 10), 9, clock.now()) {
            Admit::Queued { position, .. } => positions.push(position),
            Admit::Refused(r) => break r,
            Admit::Dispatch(_) => panic!("no room"),
        }
    };
    assert_eq!(refused.reason, RefusalReason::PredictedWait);
    assert_eq!(positions.len(), 22);
    assert_eq!(refused.position, Some(23));
    let wait = refused.retry_after.unwrap().as_duration();
    assert!(wait > Duration::from_secs(15), "{wait:?}");
}

#[test]
fn waits_that_run_past_their_prediction_make_later_predictions_longer() {
    let clock = ManualClock::new();
    let mut cfg = AdmissionConfig::new();
    cfg.tiers = vec![WaitBudget {
        normal: Duration::from_secs(3),
        soft: Duration::from_secs(3),
    }];
    let mut a = Admission::new(cfg);
    a.set_model(
        "m",
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane: lane(100, 200, 300),
        },
    );
    a.set_backends(&"m", vec![backend("b0", 1, None)]);
    // Measure a service time of 1 s; then a request holds the one slot far longer than
    // that (an engine stuck on a long answer: nothing the queue model knows of).
    serve(&mut a, &clock, "a", 0, 1, Duration::from_secs(1));
    let _stuck = dispatched(a.admit(&req("a", 0, 10), 1, clock.now()));
    // The first place is predicted at (1 + 1.65) s, inside the 3 s budget: queued. Each
    // such request waits out its budget; the tier's predictions learn from it, and within
    // a few timeouts a request in the same place is refused at arrival instead.
    let mut timeouts = 0;
    let refusal = loop {
        match a.admit(&req("b", 0, 10), 2, clock.now()) {
            Admit::Queued { .. } => {
                clock.advance(Duration::from_millis(3_001));
                let gone = a.expire(&"m", clock.now());
                assert_eq!(gone.len(), 1);
                assert_eq!(gone[0].reason, RefusalReason::QueueTimeout);
                timeouts += 1;
                assert!(timeouts <= 5, "still queued after {timeouts} timeouts");
            }
            Admit::Refused(r) => break r,
            Admit::Dispatch(_) => panic!("the slot is held"),
        }
    };
    assert_eq!(refusal.reason, RefusalReason::PredictedWait);
    assert!(timeouts >= 1);
    let wait = refusal.retry_after.unwrap().as_duration();
    assert!(wait > Duration::from_secs(3), "{wait:?}");
    // The correction is the tenant's own: a neighbour in the same place is still queued.
    queued(a.admit(&req("c", 0, 10), 3, clock.now()));
}

#[test]
fn a_tenant_held_to_its_share_is_predicted_at_its_own_pace() {
    let clock = ManualClock::new();
    let mut a = admission(10, None, lane(1_000, 2_000, 3_000));
    // Measure a service time of 1 s on all 10 slots.
    serve(&mut a, &clock, "f", 1, 10, Duration::from_secs(1));
    let mut held = Vec::new();
    // A quiet peer holds 5; the flooder gets the other 5 and then queues.
    for i in 0..5 {
        held.push(dispatched(a.admit(&req("q", 1, 10), 100 + i, clock.now())));
        held.push(dispatched(a.admit(&req("f", 1, 10), 200 + i, clock.now())));
    }
    // The lane drains 10 per second, but the flooder, held to its share, only its own 5:
    // its n-th queued request waits about n / 5 s ((n + 1.65·√n) / 5 s at the 95th
    // percentile), and tier 1 waits at most 15 s.
    let mut queued_count = 0;
    let refused = loop {
        match a.admit(&req("f", 1, 10), 300, clock.now()) {
            Admit::Queued { .. } => queued_count += 1,
            Admit::Refused(r) => break r,
            Admit::Dispatch(_) => panic!("no room"),
        }
    };
    assert_eq!(refused.reason, RefusalReason::PredictedWait);
    // n = 62 fits (14.998 s); n = 63 would take 15.2 s. The lane's pace alone would have
    // queued about 130.
    assert_eq!(queued_count, 62);
    let wait = refused.retry_after.unwrap().as_duration();
    assert!(wait > Duration::from_secs(15), "{wait:?}");
}

#[test]
fn a_lower_tier_is_refused_at_once_while_higher_tiers_take_the_lane() {
    let clock = ManualClock::new();
    let mut a = admission(2, None, lane(100, 200, 300));
    // Measure a service time of 1 s on both slots: the lane serves 2 requests/s.
    serve(&mut a, &clock, "p", 0, 2, Duration::from_secs(1));
    let _running: Vec<_> = (0..2)
        .map(|i| dispatched(a.admit(&req("p", 0, 10), 10 + i, clock.now())))
        .collect();
    // Tier 0 keeps coming, faster than the lane serves: 20 in a second.
    for i in 0..20 {
        clock.advance(Duration::from_millis(50));
        queued(a.admit(&req("p", 0, 10), 100 + i, clock.now()));
    }
    // A tier-1 request would stand behind those 20 — (21 + 1.65·√21) / 2 ≈ 14 s, inside its
    // 15 s — but everything that frees goes to tier 0 while tier 0 arrives this fast: its
    // queue would not move. Refused now, not after 15 s.
    let r = refusal(a.admit(&req("b", 1, 10), 200, clock.now()));
    assert_eq!(r.reason, RefusalReason::PredictedWait);
}

#[test]
fn an_unservable_lane_refuses_and_drains_its_queue_at_once() {
    let clock = ManualClock::new();
    let mut a = admission(1, None, lane(100, 200, 300));
    let d = dispatched(a.admit(&req("a", 0, 10), 1, clock.now()));
    queued(a.admit(&req("a", 0, 10), 2, clock.now()));
    assert!(a.fail_unservable(&"m", clock.now()).is_empty());
    a.set_routable(&"m", "b0", false);
    let gone = a.fail_unservable(&"m", clock.now());
    assert_eq!(gone.len(), 1);
    assert_eq!(
        gone[0].reason,
        RefusalReason::Unservable(Unservable::NoHealthyBackend)
    );
    let r = refusal(a.admit(&req("a", 0, 10), 3, clock.now()));
    assert_eq!(r.reason.code(), "no_healthy_backend");
    a.complete(d.grant, ok(), clock.now());
}

#[test]
fn a_lane_whose_backends_are_all_ejected_has_no_healthy_backend() {
    let clock = ManualClock::new();
    let mut a = admission(1, None, lane(100, 200, 300));
    a.set_backends(&"m", vec![backend("b0", 1, None), backend("b1", 1, None)]);
    let t0 = clock.now();
    a.eject(&"m", "b0", t0 + Duration::from_secs(30), t0);
    assert!(a.fail_unservable(&"m", t0).is_empty(), "b1 still serves");
    a.eject(&"m", "b1", t0 + Duration::from_secs(10), t0);
    let r = refusal(a.admit(&req("a", 0, 10), 1, t0));
    assert_eq!(r.reason.code(), "no_healthy_backend");
    // Retry when the first ejection ends, not never.
    assert_eq!(
        r.retry_after.unwrap().as_duration(),
        Duration::from_secs(10)
    );
    // When an ejection ends the backend is healthy again (its breaker lets a probe through).
    clock.advance(Duration::from_secs(10));
    dispatched(a.admit(&req("a", 0, 10), 2, clock.now()));
}

#[test]
fn redispatch_moves_a_failed_request_to_another_backend() {
    let clock = ManualClock::new();
    let mut a = admission(1, None, lane(100, 200, 300));
    a.set_backends(&"m", vec![backend("b0", 1, None), backend("b1", 1, None)]);
    let mut d = dispatched(a.admit(&req("a", 0, 10), 1, clock.now()));
    let first = d.grant.backend().cloned().unwrap();
    assert!(a.redispatch(&mut d.grant, Outcome::BackendFailure, clock.now()));
    let second = d.grant.backend().cloned().unwrap();
    assert_ne!(first, second);
    // Never back to the backend that just failed it; with the first one free again, there.
    assert!(a.redispatch(&mut d.grant, Outcome::BackendFailure, clock.now()));
    assert_eq!(d.grant.backend(), Some(&first));
    // With one backend only, there is nowhere else to go.
    a.set_backends(&"m", vec![backend("b0", 1, None)]);
    assert!(!a.redispatch(&mut d.grant, Outcome::BackendFailure, clock.now()));
    assert!(d.grant.backend().is_none());
    a.refund(d.grant, clock.now());
}

#[test]
fn cancel_refunds_and_frees_concurrency() {
    let clock = ManualClock::new();
    let mut a = limited(
        LimitSpec {
            max_concurrent: Some(2),
            ..LimitSpec::UNLIMITED
        },
        1,
    );
    let d = dispatched(a.admit(&req("a", 0, 10), 1, clock.now()));
    let t = queued(a.admit(&req("a", 0, 10), 2, clock.now()));
    assert_eq!(
        refusal(a.admit(&req("a", 0, 10), 3, clock.now())).reason,
        RefusalReason::Concurrency(Scope::Tenant)
    );
    assert_eq!(a.cancel(&"m", t, clock.now()), Some(2));
    queued(a.admit(&req("a", 0, 10), 4, clock.now()));
    a.complete(d.grant, ok(), clock.now());
}

/// One model "m" with two 4-slot backends and session affinity at ε.
fn two_with_affinity(epsilon: f64) -> Admission<u32, &'static str> {
    let mut cfg = lane(100, 200, 300);
    cfg.affinity = Some(AffinityConfig {
        epsilon,
        max_sessions: 100,
    });
    let mut a = admission(4, None, cfg);
    a.set_backends(&"m", vec![backend("b0", 4, None), backend("b1", 4, None)]);
    a
}

fn in_session(session: u64) -> AdmissionRequest<&'static str> {
    AdmissionRequest {
        session: Some(session),
        ..req("t", 0, 10)
    }
}

#[test]
fn a_session_returns_to_its_backend_within_the_load_bound() {
    let t0 = Timestamp::ZERO;
    let mut a = two_with_affinity(1.0);
    // Session 7's first turn goes to the least-loaded backend, b0.
    let first = dispatched(a.admit(&in_session(7), 1, t0));
    assert_eq!(first.grant.backend().map(|b| &**b), Some("b0"));
    a.complete(first.grant, ok(), t0);
    // Another request now holds b0, so load alone would send the next turn to b1.
    let other = dispatched(a.admit(&req("u", 0, 10), 2, t0));
    assert_eq!(other.grant.backend().map(|b| &**b), Some("b0"));
    let plain = dispatched(a.admit(&req("u", 0, 10), 3, t0));
    assert_eq!(plain.grant.backend().map(|b| &**b), Some("b1"));
    a.complete(plain.grant, ok(), t0);
    // The session's second turn goes back to b0: 2 in flight there after it is within
    // ⌈2 · (1 + 1) / 2⌉ = 2.
    let second = dispatched(a.admit(&in_session(7), 4, t0));
    assert_eq!(second.grant.backend().map(|b| &**b), Some("b0"));
    // A third turn (b0 would hold 3 of L + 1 = 3; bound ⌈2 · 3 / 2⌉ = 3) still fits.
    let third = dispatched(a.admit(&in_session(7), 5, t0));
    assert_eq!(third.grant.backend().map(|b| &**b), Some("b0"));
    // At ε = 0.25 a session spills sooner.
    let mut tight = two_with_affinity(0.25);
    let g = dispatched(tight.admit(&in_session(9), 1, t0));
    assert_eq!(g.grant.backend().map(|b| &**b), Some("b0"));
    // b0 at 1, b1 at 0: a second turn makes b0 hold 2, within ⌈1.25 · 2 / 2⌉ = 2: kept.
    let g2 = dispatched(tight.admit(&in_session(9), 2, t0));
    assert_eq!(g2.grant.backend().map(|b| &**b), Some("b0"));
    // A third: b0 would hold 3 > ⌈1.25 · 3 / 2⌉ = 2: the session spills to b1.
    let g3 = dispatched(tight.admit(&in_session(9), 3, t0));
    assert_eq!(g3.grant.backend().map(|b| &**b), Some("b1"));
}

/// Under a queue, the backend that frees a slot takes the queued turn it holds warm, not the
/// oldest (warm elsewhere): the oldest waits for its own backend. (The bound on how often it
/// may be passed over is the queue's, tested there.)
#[test]
fn a_freed_backend_takes_the_queued_turn_it_holds_warm() {
    let t0 = Timestamp::ZERO;
    let mut a = two_with_affinity(1.0);
    // First turns of sessions 1..=8 fill both backends, alternating: odd on b0, even on b1.
    let mut first = Vec::new();
    for s in 1..=8u64 {
        let d = dispatched(a.admit(&in_session(s), s as u32, t0));
        let want = if s % 2 == 1 { "b0" } else { "b1" };
        assert_eq!(d.grant.backend().map(|b| &**b), Some(want), "session {s}");
        first.push(d);
    }
    // Second turns queue, oldest first: 2 and 4 (warm on b1), then 1 (warm on b0).
    for s in [2u64, 4, 1] {
        queued(a.admit(&in_session(s), 10 + s as u32, t0));
    }
    // b0 frees a slot (session 3's first turn ends): it takes session 1's turn, warm there.
    let on_b0 = first.remove(2);
    a.complete(on_b0.grant, ok(), t0);
    let d = a.dequeue(&"m", t0).unwrap();
    assert_eq!(d.item, 11, "the turn warm on b0 goes first");
    assert_eq!(d.grant.backend().map(|b| &**b), Some("b0"));
    // b1 frees one: the oldest, session 2's turn, goes there.
    let on_b1 = first.remove(1);
    a.complete(on_b1.grant, ok(), t0);
    let d = a.dequeue(&"m", t0).unwrap();
    assert_eq!(d.item, 12);
    assert_eq!(d.grant.backend().map(|b| &**b), Some("b1"));
}

#[test]
fn without_affinity_a_session_goes_by_load() {
    let t0 = Timestamp::ZERO;
    let mut a = admission(4, None, lane(100, 200, 300));
    a.set_backends(&"m", vec![backend("b0", 4, None), backend("b1", 4, None)]);
    let first = dispatched(a.admit(&in_session(7), 1, t0));
    assert_eq!(first.grant.backend().map(|b| &**b), Some("b0"));
    a.complete(first.grant, ok(), t0);
    let _other = dispatched(a.admit(&req("u", 0, 10), 2, t0));
    let second = dispatched(a.admit(&in_session(7), 4, t0));
    assert_eq!(second.grant.backend().map(|b| &**b), Some("b1"));
}

/// A request whose time to first token, learned from the backend's responses, would miss
/// its tier's objective even if dispatched now is refused at once, with the predicted
/// excess as Retry-After; one that meets it goes; a tier without an objective is never
/// refused for it; and before the backend's fit predicts anything nothing is refused.
#[test]
fn a_request_predicted_to_miss_its_tiers_ttft_objective_is_refused_at_once() {
    let clock = ManualClock::new();
    let mut cfg = lane(100, 200, 300);
    cfg.slo = vec![
        LatencySlo {
            ttft: Some(MS(500)),
            tpot: None,
        },
        LatencySlo::default(),
    ];
    let mut a = admission(8, None, cfg);
    // The engine: 100 ms plus 1 ms per prompt token to the first token. Before 16 answers
    // nothing is predicted: a long prompt still goes.
    let long = dispatched(a.admit(&req("t", 0, 2_000), 0, clock.now()));
    a.complete(long.grant, ok(), clock.now());
    for i in 0..20u64 {
        let prompt = 50 + 17 * i;
        let d = dispatched(a.admit(&req("t", 0, prompt), 1, clock.now()));
        let ttft = MS(100 + prompt);
        // Each request is alone: the prefill ahead of it is its own prompt.
        a.observe(&d.grant, Some(ttft), None);
        clock.advance(MS(1_000));
        a.complete(d.grant, ok(), clock.now());
    }
    // 300 tokens: 400 ms predicted, within 500 ms.
    let short = dispatched(a.admit(&req("t", 0, 300), 2, clock.now()));
    a.complete(short.grant, ok(), clock.now());
    // 1,000 tokens, while those 300 are still being prefilled: 1.4 s predicted, 900 ms past
    // the objective.
    let r = refusal(a.admit(&req("t", 0, 1_000), 3, clock.now()));
    assert_eq!(r.reason, RefusalReason::PredictedSloMiss);
    assert_eq!(r.reason.code(), "slo_unattainable");
    let retry = r.retry_after.unwrap().as_duration();
    assert!(retry >= MS(890) && retry <= MS(910), "{retry:?}");
    // Once they are predicted done: 1.1 s, 600 ms past.
    clock.advance(MS(400));
    let r = refusal(a.admit(&req("t", 0, 1_000), 3, clock.now()));
    let retry = r.retry_after.unwrap().as_duration();
    assert!(retry >= MS(590) && retry <= MS(610), "{retry:?}");
    // Tier 1 has no objective: the same request goes.
    let other = dispatched(a.admit(&req("u", 1, 1_000), 4, clock.now()));
    a.complete(other.grant, ok(), clock.now());
}

/// With preemption on, a request of a tenant under its share that would wait behind a
/// flooder's requests is not refused for a predicted miss of its tier's TTFT objective:
/// preemption gives it a slot at once, so its predicted wait is the cut's, not the queue's.
/// Without preemption the same request is refused; with it the lane names a flooder's
/// request to cut short right after.
#[test]
fn a_request_preemption_will_place_is_not_refused_for_its_queue_wait() {
    for preempt in [false, true] {
        let clock = ManualClock::new();
        let mut cfg = lane(100, 200, 300);
        cfg.slo = vec![LatencySlo {
            ttft: Some(MS(500)),
            tpot: None,
        }];
        cfg.preempt = preempt;
        let mut a = admission(4, None, cfg);
        // The engine: 100 ms plus 1 ms per prompt token to the first token; each request
        // held 1 s. The quiet tenant's requests are among them.
        for i in 0..20u64 {
            let prompt = 50 + 17 * i;
            let tenant = if i % 4 == 0 { "q" } else { "f" };
            let d = dispatched(a.admit(&req(tenant, 0, prompt), 1, clock.now()));
            a.observe(&d.grant, Some(MS(100 + prompt)), None);
            clock.advance(MS(1_000));
            a.complete(d.grant, ok(), clock.now());
        }
        // The flooder: a request every 50 ms for a minute (its arrival rate is judged over
        // one), far past its half of the four slots, which it fills; the rest waits or is
        // refused for its own predicted wait.
        let mut running = Vec::new();
        for i in 0..1_200u32 {
            if let Admit::Dispatch(d) = a.admit(&req("f", 0, 10), 100 + i, clock.now()) {
                running.push(d);
            }
            clock.advance(MS(50));
        }
        assert_eq!(running.len(), 4, "preempt = {preempt}");
        let quiet = a.admit(&req("q", 0, 100), 200, clock.now());
        if preempt {
            queued(quiet);
            assert!(
                a.preempt(&"m", clock.now()).is_some(),
                "a flooder's request is named to make room"
            );
        } else {
            let r = refusal(quiet);
            assert_eq!(r.reason, RefusalReason::PredictedSloMiss);
        }
    }
}
