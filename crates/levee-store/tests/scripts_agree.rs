//! The Lua limit scripts (GCRA for request rates, the token bucket for token rates, on a
//! Redis server) and levee-policy's `Gcra` and `TokenBucket` (in a `MemoryStore`, which is
//! them behind a lock) decide the same random sequences of times and costs alike: every
//! decision, every refusal's scope, kind and wait, and every figure of the `x-ratelimit-*`
//! headers must be equal, settlements and slices included.
//!
//! Both run on one manual clock: the scripts take the time as their optional last argument
//! (`RedisStore::with_clock`) instead of reading the server's `TIME`. The clock starts at a
//! real date's microseconds, the magnitude of `TIME` in production, where a double's step is
//! a quarter of a microsecond. Periods are whole seconds and counts divide them into whole
//! microseconds, so both sides' arithmetic is exact and they must agree to the microsecond
//! (the scripts' half-microsecond slack for floating-point error never decides). Besides
//! random gaps, the clock jumps to exactly a refusal's `retry_after`, and a microsecond
//! before and after it, where a disagreement at the boundary would show.
//!
//! Uses the Redis on 127.0.0.1:6379 under a key prefix of its own, deleted afterwards;
//! skipped with a message when it is unreachable, unless `LEVEE_REQUIRE_REDIS=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::redis_store;
use levee_policy::{Clock, ManualClock, Quota, Timestamp, TokenQuota};
use levee_store::{
    Decision, LimitStore, MemoryStore, RedisStore, ScopeLimits, Settlement, SliceDecision,
};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;

/// 2025-12-01 00:00:00 UTC in microseconds.
const T0_US: u64 = 1_764_547_200_000_000;

/// A rate: `count` per `secs` seconds, `count` a divisor of the period's microseconds.
#[derive(Debug, Clone, Copy)]
struct Rate {
    secs: u64,
    count: u64,
    /// The burst (requests) or capacity (tokens).
    depth: u64,
}

fn rate(max_depth: u64) -> impl Strategy<Value = Rate> {
    (1u64..=120, 0u32..=6, 0u32..=6, 1u64..=120, 1..=max_depth).prop_map(
        |(secs, twos, fives, k, depth)| {
            // 2^a·5^b divides 10^6 and gcd(secs, k) divides secs: the interval, the period's
            // microseconds over the count, is whole.
            let mut g = (secs, k);
            while g.1 != 0 {
                g = (g.1, g.0 % g.1);
            }
            let count = 2u64.pow(twos) * 5u64.pow(fives) * g.0;
            Rate { secs, count, depth }
        },
    )
}

#[derive(Debug, Clone)]
enum Op {
    Take(u64),
    /// Settle the n-th open grant (mod the number open) with this many tokens used.
    Reconcile(usize, u64),
    Refund(usize),
    /// A slice of at most this many requests and tokens, at least this many tokens.
    Slice(u64, u64, u64),
    /// Give the n-th open slice back unused.
    ReturnSlice(usize),
    /// Let this many microseconds pass.
    Wait(u64),
    /// Let the last refusal's wait pass, less one microsecond, exactly, or plus one (-1, 0, 1).
    WaitRetry(i8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..=120).prop_map(Op::Take),
        2 => (any::<usize>(), 0u64..=200).prop_map(|(i, a)| Op::Reconcile(i, a)),
        1 => any::<usize>().prop_map(Op::Refund),
        2 => (1u64..8, 0u64..=150, 0u64..=60).prop_map(|(r, t, m)| Op::Slice(r, t.max(m), m)),
        1 => any::<usize>().prop_map(Op::ReturnSlice),
        // Gaps from a microsecond to a minute and a half, about evenly spread in magnitude.
        4 => (1u64..=9, 0u32..=7).prop_map(|(m, e)| Op::Wait(m * 10u64.pow(e))),
        3 => (-1i8..=1).prop_map(Op::WaitRetry),
    ]
}

/// Two scopes (global, tenant), each with an optional request rate and token rate.
type Limits = [(Option<Rate>, Option<Rate>); 2];

fn limits() -> impl Strategy<Value = Limits> {
    let scope = || {
        (
            prop::option::weighted(0.6, rate(12)),
            prop::option::weighted(0.6, rate(150)),
        )
    };
    [scope(), scope()]
}

fn scopes(limits: &Limits, case: u32) -> Vec<ScopeLimits> {
    limits
        .iter()
        .zip(["global", "t:tenant"])
        .map(|((r, t), name)| ScopeLimits {
            id: Arc::from(format!("{name}-{case}")),
            requests: r
                .map(|r| Quota::new(r.count, Duration::from_secs(r.secs)).with_burst(r.depth)),
            tokens: t.map(|t| {
                TokenQuota::new(t.count, Duration::from_secs(t.secs)).with_capacity(t.depth)
            }),
            concurrency: None,
        })
        .collect()
}

/// Runs `ops` on both stores, which share `clock`; returns the first disagreement.
async fn agree(
    redis: &RedisStore,
    memory: &MemoryStore<ManualClock>,
    clock: &ManualClock,
    scopes: &[ScopeLimits],
    ops: &[Op],
) -> Result<(), String> {
    let mut open: Vec<u64> = Vec::new();
    let mut slices: Vec<(u64, u64)> = Vec::new();
    let mut last_wait: Option<Duration> = None;
    let err = |e: levee_store::StoreError| e.to_string();
    for (step, op) in ops.iter().enumerate() {
        let at = clock.now().as_nanos() / 1000 - T0_US;
        let settle = |s: Settlement| async move {
            redis.settle(scopes, s, "").await.map_err(err)?;
            memory.settle(scopes, s, "").await.map_err(err)
        };
        match *op {
            Op::Take(tokens) => {
                let lua = redis.take(scopes, tokens, "").await.map_err(err)?;
                let rust = memory.take(scopes, tokens, "").await.map_err(err)?;
                if lua != rust {
                    return Err(format!(
                        "step {step} (t0 + {at} µs): take({tokens}): Lua {lua:?}, Rust {rust:?}"
                    ));
                }
                match rust {
                    Decision::Admitted(_) => open.push(tokens),
                    Decision::Refused { retry_after, .. } => last_wait = Some(retry_after),
                }
            }
            Op::Reconcile(i, _) | Op::Refund(i) if !open.is_empty() => {
                let reserved = open.remove(i % open.len());
                settle(match *op {
                    Op::Reconcile(_, actual) => Settlement::reconcile(reserved, actual),
                    _ => Settlement::refund(reserved),
                })
                .await?;
            }
            Op::Slice(r, t, min) => {
                let lua = redis.take_slice(scopes, r, t, min).await.map_err(err)?;
                let rust = memory.take_slice(scopes, r, t, min).await.map_err(err)?;
                if lua != rust {
                    return Err(format!(
                        "step {step} (t0 + {at} µs): slice({r}, {t}, {min}): Lua {lua:?}, Rust {rust:?}"
                    ));
                }
                match rust {
                    SliceDecision::Granted(g) => slices.push((g.requests, g.tokens)),
                    SliceDecision::Refused { retry_after, .. } => last_wait = Some(retry_after),
                }
            }
            Op::ReturnSlice(i) if !slices.is_empty() => {
                let (r, t) = slices.remove(i % slices.len());
                settle(Settlement::unused(r, t)).await?;
            }
            Op::Wait(us) => clock.advance(Duration::from_micros(us)),
            Op::WaitRetry(delta) => {
                if let Some(w) = last_wait.take().filter(|w| !w.is_zero()) {
                    let us = w.as_micros() as i128 + delta as i128;
                    clock.advance(Duration::from_micros(us.max(0) as u64));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[test]
fn lua_scripts_decide_as_the_rust_limiters() {
    let Some((rt, store)) = redis_store("agree") else {
        return;
    };
    let n = std::cell::Cell::new(0u32);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    });
    let result = runner.run(
        &(limits(), prop::collection::vec(op(), 1..80)),
        |(limits, ops)| {
            // Fresh keys and a fresh clock per case: a case never sees another's state.
            n.set(n.get() + 1);
            let clock = ManualClock::starting_at(Timestamp::from_nanos(T0_US * 1000));
            let redis = store.clone().with_clock(Arc::new(clock.clone()));
            let memory = MemoryStore::new(clock.clone());
            let scopes = scopes(&limits, n.get());
            let r = rt.block_on(agree(&redis, &memory, &clock, &scopes, &ops));
            prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            Ok(())
        },
    );
    let cleared = rt.block_on(store.clear());
    result.unwrap();
    cleared.unwrap();
}

/// Without a clock the scripts read the server's `TIME`, as every replica of a fleet does:
/// a fresh tenant at five per second with a burst of two is admitted twice, then refused
/// with a wait of at most one interval.
#[test]
fn without_a_clock_the_scripts_use_the_servers_time() {
    let Some((rt, store)) = redis_store("server-time") else {
        return;
    };
    let scopes = [ScopeLimits {
        id: Arc::from("t:server-time"),
        requests: Some(Quota::per_second(5).with_burst(2)),
        tokens: None,
        concurrency: None,
    }];
    rt.block_on(async {
        for _ in 0..2 {
            let d = store.take(&scopes, 0, "").await.unwrap();
            assert!(matches!(d, Decision::Admitted(_)), "{d:?}");
        }
        match store.take(&scopes, 0, "").await.unwrap() {
            Decision::Refused { retry_after, .. } => {
                assert!(!retry_after.is_zero() && retry_after <= Duration::from_millis(200))
            }
            d => panic!("a third request at once was admitted: {d:?}"),
        }
        store.clear().await.unwrap();
    });
}

/// One renewal in [`fleet_script_splits_as_the_rust_rule`]: a replica (0..4), its wants per
/// priority class (slots, KV tokens), and what it has in flight; `None` wants: it returns
/// its slice.
type Renewal = (usize, Option<Vec<(u64, u64)>>, (u64, u64));

/// What the model keeps of a replica's record: its wants per class and its holding.
type Record = (Vec<(u64, u64)>, (u64, u64));

fn renewal() -> impl Strategy<Value = Renewal> {
    (
        0usize..4,
        prop::option::weighted(0.9, prop::collection::vec((0u64..30, 0u64..3_000), 0..4)),
        (0u64..20, 0u64..2_000),
    )
}

/// The backend-budget lease script (`fleet.lua`) and levee-policy's `tiered_split` decide
/// the same grants: random renewals and returns of up to four replicas, each asking per
/// priority class, get exactly `min(tiered_split(the live replicas' wants)[me], budget −
/// what the others hold)` in slots and in KV tokens, with the others' holdings and the
/// live count the model keeps; a replica's holding is `max(grant, in flight)`.
#[test]
fn fleet_script_splits_as_the_rust_rule() {
    use levee_policy::{tiered_split, Budget};
    let Some((rt, store)) = redis_store("agree-fleet") else {
        return;
    };
    let lease = Duration::from_secs(60);
    let n = std::cell::Cell::new(0u32);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 128,
        ..ProptestConfig::default()
    });
    let result = runner.run(
        &(
            1u64..40,
            1u64..10_000,
            prop::collection::vec(renewal(), 1..40),
        ),
        |(slots, kv, ops)| {
            n.set(n.get() + 1);
            let backend = format!("m@agree{}", n.get());
            let budget = Budget {
                slots,
                kv_tokens: kv,
            };
            // Per replica, while it holds a record: its wants per class and its holding.
            let mut live: [Option<Record>; 4] = Default::default();
            for (step, (r, wants, used)) in ops.into_iter().enumerate() {
                let wants: Vec<(u64, u64)> = wants
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(s, k)| (s.min(slots), k.min(kv)))
                    .collect();
                let in_flight = Budget {
                    slots: used.0,
                    kv_tokens: used.1,
                };
                let asked: Vec<Budget> = wants
                    .iter()
                    .map(|&(s, k)| Budget {
                        slots: s,
                        kv_tokens: k,
                    })
                    .collect();
                let g = rt
                    .block_on(store.lease_backend(
                        &backend,
                        &format!("r{r}"),
                        lease,
                        budget,
                        &asked,
                        in_flight,
                    ))
                    .unwrap();
                // The model: every replica in id order (r0..r3; one without a record wants
                // nothing, which changes no one's part), this one with its new wants.
                let column = |k: usize| -> Vec<Vec<u64>> {
                    (0..4)
                        .map(|j| {
                            let w = if j == r {
                                Some(&wants)
                            } else {
                                live[j].as_ref().map(|(w, _)| w)
                            };
                            w.map_or(Vec::new(), |w| {
                                w.iter().map(|p| if k == 0 { p.0 } else { p.1 }).collect()
                            })
                        })
                        .collect()
                };
                let others = |k: usize| -> u64 {
                    live.iter()
                        .enumerate()
                        .filter(|(j, _)| *j != r)
                        .filter_map(|(_, l)| l.as_ref())
                        .map(|(_, h)| if k == 0 { h.0 } else { h.1 })
                        .sum()
                };
                let expect_s =
                    tiered_split(&column(0), slots)[r].min(slots.saturating_sub(others(0)));
                let expect_k = tiered_split(&column(1), kv)[r].min(kv.saturating_sub(others(1)));
                let replicas = 1 + live
                    .iter()
                    .enumerate()
                    .filter(|(j, l)| *j != r && l.is_some())
                    .count() as u32;
                let model = (expect_s, expect_k, others(0), others(1), replicas);
                let lua = (
                    g.allowed.slots,
                    g.allowed.kv_tokens,
                    g.others.slots,
                    g.others.kv_tokens,
                    g.replicas,
                );
                prop_assert_eq!(
                    lua,
                    model,
                    "step {}: replica r{} wants {:?}, in flight {:?} (Lua, model)",
                    step,
                    r,
                    &wants,
                    used
                );
                let active = used != (0, 0) || wants.iter().any(|&w| w != (0, 0));
                live[r] = active.then(|| {
                    (
                        wants,
                        (
                            expect_s.max(in_flight.slots),
                            expect_k.max(in_flight.kv_tokens),
                        ),
                    )
                });
            }
            Ok(())
        },
    );
    let cleared = rt.block_on(store.clear());
    result.unwrap();
    cleared.unwrap();
}
