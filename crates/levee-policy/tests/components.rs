//! Each component driven by a `ManualClock`, the way the gateway drives them with the
//! system clock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use std::time::Duration;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn gcra_with_manual_clock() {
    let clock = ManualClock::new();
    let mut g = Gcra::new(Quota::per_minute(60).with_burst(2));
    assert!(g.check(clock.now()).is_ok());
    assert!(g.check(clock.now()).is_ok());
    let e = g.check(clock.now()).unwrap_err();
    assert_eq!(e.retry_after, Duration::from_secs(1));
    clock.advance(e.retry_after);
    assert!(g.check(clock.now()).is_ok());
    let info = g.info(clock.now());
    assert_eq!((info.limit, info.remaining), (2, 0));
    assert_eq!(info.reset_after, Duration::from_secs(2));
}

#[test]
fn keyed_gcra_evicts_idle_keys_with_manual_clock() {
    let clock = ManualClock::new();
    let mut k: KeyedGcra<Key> = KeyedGcra::new(Some(Quota::per_second(10)), 100);
    for i in 0..50 {
        k.check(&Key::new(&format!("ip-{i}")), clock.now()).unwrap();
    }
    assert_eq!(k.tracked_keys(), 50);
    assert_eq!(k.evict_idle(clock.now()), 0, "all still owe a little");
    clock.advance(ms(100));
    assert_eq!(k.evict_idle(clock.now()), 50);
}

#[test]
fn token_limiter_with_manual_clock() {
    let clock = ManualClock::new();
    let mut l: TokenLimiter<Key> = TokenLimiter::new(Some(TokenQuota::per_minute(60_000)), 10);
    let acme = Key::new("acme");
    let r = l.reserve(&acme, 50_000, clock.now()).unwrap();
    let refused = l.reserve(&acme, 20_000, clock.now()).unwrap_err();
    // 10 000 short at 1 000 tokens/s.
    assert_eq!(refused.retry_after(), Some(Duration::from_secs(10)));
    clock.advance(Duration::from_secs(1));
    l.reconcile(r, 5_000, clock.now());
    assert_eq!(l.available(&acme, clock.now()), Some(56_000));
    assert!(l.reserve(&acme, 20_000, clock.now()).is_ok());
}

#[test]
fn watermarks_with_measured_drain() {
    let clock = ManualClock::new();
    let w = Watermarks::new(4, 8, 12).unwrap();
    let budget = WaitBudget {
        normal: Duration::from_secs(10),
        soft: Duration::from_secs(2),
    };
    let bounds = RetryBounds {
        min: ms(100),
        max: Duration::from_secs(30),
    };
    let mut drain = DrainRate::new(Duration::from_secs(2));
    // Nothing measured yet: a refusal gets the upper bound, not a made-up constant.
    let d = w.decide(12, budget, &drain, &bounds, clock.now());
    assert_eq!(d.action, WatermarkAction::Refuse);
    assert_eq!(d.retry_after.as_duration(), Duration::from_secs(30));
    for _ in 0..400 {
        clock.advance(ms(25)); // 40 dispatches per second
        drain.record(1, clock.now());
    }
    let d = w.decide(12, budget, &drain, &bounds, clock.now());
    // (12 + 1 − 8) = 5 to drain at ≈ 40/s ≈ 125 ms.
    assert!(
        (120..=140).contains(&d.retry_after.as_millis()),
        "{:?}",
        d.retry_after
    );
    assert_eq!(d.retry_after.header_secs(), 1);
    let d = w.decide(5, budget, &drain, &bounds, clock.now());
    assert_eq!(
        d.action,
        WatermarkAction::Wait {
            budget: Duration::from_secs(10)
        }
    );
    assert_eq!(d.zone, LoadZone::SafeToSoft);
}

#[test]
fn fair_queue_expiry_with_manual_clock() {
    let clock = ManualClock::new();
    let mut q: FairQueue<&str, Key> = FairQueue::new(QueueLimits {
        tiers: 2,
        max_len: 10,
        max_tokens: 10_000,
    });
    let a = Key::new("a");
    q.push(
        Tier(1),
        a.clone(),
        10,
        clock.now(),
        clock.now() + ms(50),
        "late",
    )
    .unwrap();
    q.push(
        Tier(0),
        a.clone(),
        10,
        clock.now(),
        clock.now() + ms(500),
        "vip",
    )
    .unwrap();
    clock.advance(ms(60));
    let ex = q.expire(clock.now());
    assert_eq!(ex.len(), 1);
    assert_eq!(ex[0].item, "late");
    assert_eq!(clock.now() - ex[0].enqueued_at, ms(60));
    assert_eq!(q.next_deadline(), Some(Timestamp::ZERO + ms(500)));
    let st = q.stats();
    assert_eq!((st.tiers[0].len, st.tiers[1].len), (1, 0));
    assert_eq!(q.backlogged().count(), 1);
}

#[test]
fn breaker_cooldown_with_manual_clock() {
    let clock = ManualClock::new();
    let mut b = Breaker::new(BreakerConfig {
        consecutive_failures: 2,
        cooldown: Duration::from_secs(3),
        ..BreakerConfig::default()
    });
    for _ in 0..2 {
        let t = b.try_acquire(clock.now()).unwrap();
        b.record(t, Outcome::BackendFailure, clock.now());
    }
    assert_eq!(b.state(clock.now()), BreakerState::Open);
    assert_eq!(
        b.try_acquire(clock.now()).unwrap_err().retry_after,
        Duration::from_secs(3)
    );
    clock.advance(Duration::from_secs(3));
    assert_eq!(b.state(clock.now()), BreakerState::HalfOpen);
    let probe = b.try_acquire(clock.now()).unwrap();
    assert!(probe.is_probe());
    b.record(probe, Outcome::Success, clock.now());
    assert_eq!(b.state(clock.now()), BreakerState::Closed);
    assert_eq!(b.stats(clock.now()).state.as_str(), "closed");
}

#[test]
fn adaptive_limit_drives_a_backend_concurrency_limit() {
    let backend = ConcurrencyLimit::new(10);
    let mut a = AdaptiveLimit::new(AdaptiveConfig {
        initial: 10,
        max: 64,
        ..Default::default()
    });
    for _ in 0..300 {
        let l = a.on_sample(ms(50), backend.limit(), false);
        backend.set_limit(l);
    }
    assert!(backend.limit() > 30);
    for _ in 0..200 {
        let l = a.on_sample(ms(300), backend.limit(), false);
        backend.set_limit(l);
    }
    assert!(backend.limit() < 32, "{}", backend.limit());
}

#[test]
fn degrade_planner_with_manual_clock() {
    let clock = ManualClock::new();
    let cfg = DegradeConfig {
        levels: vec![DegradeLevel {
            enter: 0.8,
            exit: 0.5,
            step: DegradeStep {
                max_tokens_cap: Some(256),
                use_fallback: true,
                shed_from_tier: Some(Tier(2)),
            },
        }],
        min_dwell: Duration::from_secs(30),
    };
    cfg.validate().unwrap();
    let mut p = DegradePlanner::new(cfg);
    let hot = LoadSignals {
        queue_depth_ratio: 0.2,
        ttft_ratio: 0.9,
        refusal_rate: 0.1,
        kv_cache_usage: 0.85,
    };
    assert_eq!(p.observe(hot, clock.now()), 1);
    assert!(p.plan().step.use_fallback);
    let cool = LoadSignals::default();
    clock.advance(Duration::from_secs(29));
    assert_eq!(p.observe(cool, clock.now()), 1, "dwell");
    clock.advance(Duration::from_secs(1));
    assert_eq!(p.observe(cool, clock.now()), 0);
    p.force(Some(1));
    assert_eq!(p.observe(cool, clock.now()), 1);
    p.force(None);
    assert_eq!(p.effective_level(), 0);
}

#[test]
fn permits_release_across_threads() {
    let limit = ConcurrencyLimit::new(1);
    let p = limit.try_acquire().unwrap();
    assert!(limit.try_acquire().is_err());
    std::thread::spawn(move || drop(p)).join().unwrap();
    assert!(limit.try_acquire().is_ok());
}
