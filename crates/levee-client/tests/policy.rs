// Test helpers outside #[test] fns may unwrap too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_client::{
    Backoff, Decision, GiveUp, Outcome, RetryBudget, RetryBudgetConfig, RetryPolicy,
};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::time::{Duration, Instant};

fn backoff_strategy() -> impl Strategy<Value = Backoff> {
    (0u64..5_000, 0u64..60_000, 1.0f64..4.0).prop_map(|(base, cap, multiplier)| Backoff {
        base: Duration::from_millis(base),
        cap: Duration::from_millis(cap),
        multiplier,
    })
}

proptest! {
    #[test]
    fn delays_stay_within_zero_and_cap(backoff in backoff_strategy(), retry in 0u32..200, seed: u64) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let d = backoff.delay(retry, &mut rng);
        prop_assert!(d <= backoff.cap);
        prop_assert!(d <= backoff.ceiling(retry));
    }

    #[test]
    fn retry_after_is_always_respected(
        backoff in backoff_strategy(),
        wait_ms in 0u64..120_000,
        attempt in 1u32..4,
        seed: u64,
    ) {
        let policy = RetryPolicy { backoff, max_attempts: 10, max_retry_after: Duration::from_secs(60), retry_after_jitter: 0.2 };
        let now = Instant::now();
        let mut budget = RetryBudget::new(RetryBudgetConfig { ratio: 1.0, min_per_sec: 0.0, max_tokens: 100.0 }, now);
        let mut rng = SmallRng::seed_from_u64(seed);
        let wait = Duration::from_millis(wait_ms);
        match policy.decide(attempt, Outcome::Status(429), Some(wait), &mut budget, now, &mut rng) {
            Decision::Retry(d) => {
                prop_assert!(d >= wait, "waited {d:?} < asked {wait:?}");
                prop_assert!(d <= wait.mul_f64(1.2).max(backoff.cap) + Duration::from_nanos(1));
            }
            Decision::GiveUp(GiveUp::RetryAfterTooLong(w)) => prop_assert!(w > policy.max_retry_after),
            other => prop_assert!(false, "unexpected {other:?}"),
        }
    }

    /// Whatever the interleaving of requests, failures and time, retries never exceed
    /// what the budget earned: initial tokens + ratio × requests + min_per_sec × elapsed.
    #[test]
    fn budget_is_never_exceeded(
        ratio in 0.0f64..0.5,
        min_per_sec in 0.0f64..5.0,
        max_tokens in 0.0f64..20.0,
        events in proptest::collection::vec((any::<bool>(), 0u64..2_000), 1..400),
    ) {
        let config = RetryBudgetConfig { ratio, min_per_sec, max_tokens };
        let start = Instant::now();
        let mut now = start;
        let mut budget = RetryBudget::new(config, now);
        let (mut requests, mut retries) = (0u64, 0u64);
        for (is_request, advance_ms) in events {
            now += Duration::from_millis(advance_ms);
            if is_request {
                budget.on_request(now);
                requests += 1;
            } else if budget.try_retry(now) {
                retries += 1;
            }
            let earned = max_tokens + ratio * requests as f64
                + min_per_sec * (now - start).as_secs_f64();
            prop_assert!(retries as f64 <= earned + 1e-9, "{retries} retries > {earned} earned");
        }
    }
}

#[test]
fn non_retryable_and_attempt_limit() {
    let policy = RetryPolicy::default();
    let now = Instant::now();
    let mut budget = RetryBudget::new(RetryBudgetConfig::default(), now);
    let mut rng = SmallRng::seed_from_u64(1);
    assert_eq!(
        policy.decide(1, Outcome::Status(400), None, &mut budget, now, &mut rng),
        Decision::GiveUp(GiveUp::NotRetryable)
    );
    assert_eq!(
        policy.decide(
            policy.max_attempts,
            Outcome::Timeout,
            None,
            &mut budget,
            now,
            &mut rng
        ),
        Decision::GiveUp(GiveUp::MaxAttempts)
    );
    assert!(matches!(
        policy.decide(1, Outcome::Connect, None, &mut budget, now, &mut rng),
        Decision::Retry(_)
    ));
}

#[test]
fn ten_percent_budget_under_total_failure() {
    // 1000 requests that all fail, no time passing: at most 10 (initial) + 100 retries.
    let now = Instant::now();
    let config = RetryBudgetConfig {
        ratio: 0.1,
        min_per_sec: 0.0,
        max_tokens: 10.0,
    };
    let mut budget = RetryBudget::new(config, now);
    let policy = RetryPolicy::default();
    let mut rng = SmallRng::seed_from_u64(7);
    let mut retries = 0;
    for _ in 0..1000 {
        budget.on_request(now);
        if let Decision::Retry(_) =
            policy.decide(1, Outcome::Status(503), None, &mut budget, now, &mut rng)
        {
            retries += 1;
        }
    }
    assert!(retries <= 110, "{retries}");
    assert!(retries >= 100, "budget should allow ~10%: {retries}");
}

/// Clients refused together with one Retry-After come back spread over
/// `[retry_after, 1.2 × retry_after]`, not at one instant.
#[test]
fn retry_after_is_spread_by_jitter() {
    let policy = RetryPolicy {
        backoff: Backoff {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(1),
            multiplier: 1.0,
        },
        ..RetryPolicy::default()
    };
    let now = Instant::now();
    let wait = Duration::from_secs(2);
    let mut rng = SmallRng::seed_from_u64(7);
    let mut waits = Vec::new();
    for _ in 0..1000 {
        let mut budget = RetryBudget::new(RetryBudgetConfig::default(), now);
        match policy.decide(
            1,
            Outcome::Status(429),
            Some(wait),
            &mut budget,
            now,
            &mut rng,
        ) {
            Decision::Retry(d) => waits.push(d.as_secs_f64()),
            other => panic!("unexpected {other:?}"),
        }
    }
    let min = waits.iter().cloned().fold(f64::MAX, f64::min);
    let max = waits.iter().cloned().fold(0.0, f64::max);
    assert!(min >= 2.0 && max <= 2.4 + 1e-9, "{min} .. {max}");
    // Spread over the window: each fifth of it gets a share of the clients.
    for k in 0..5 {
        let lo = 2.0 + 0.08 * k as f64;
        let n = waits.iter().filter(|&&w| w >= lo && w < lo + 0.08).count();
        assert!(n > 100, "fifth {k}: {n} of 1000");
    }
    // Without jitter every client comes back at exactly the asked time.
    let exact = RetryPolicy {
        retry_after_jitter: 0.0,
        ..policy
    };
    let mut budget = RetryBudget::new(RetryBudgetConfig::default(), now);
    assert_eq!(
        exact.decide(
            1,
            Outcome::Status(429),
            Some(wait),
            &mut budget,
            now,
            &mut rng
        ),
        Decision::Retry(wait)
    );
}

/// A degraded answer is final: even a retryable status is not retried, and no retry token
/// is spent on it.
#[test]
fn a_degraded_answer_is_not_retried() {
    let policy = RetryPolicy::default();
    let now = Instant::now();
    let config = RetryBudgetConfig {
        ratio: 0.0,
        min_per_sec: 0.0,
        max_tokens: 1.0,
    };
    let mut budget = RetryBudget::new(config, now);
    let mut rng = SmallRng::seed_from_u64(1);
    for status in [429, 500, 503] {
        assert_eq!(
            policy.decide_marked(
                1,
                Outcome::Status(status),
                None,
                true,
                &mut budget,
                now,
                &mut rng
            ),
            Decision::GiveUp(GiveUp::Degraded)
        );
    }
    // The one token is still there for an unmarked failure.
    assert!(matches!(
        policy.decide_marked(
            1,
            Outcome::Status(503),
            None,
            false,
            &mut budget,
            now,
            &mut rng
        ),
        Decision::Retry(_)
    ));
}
