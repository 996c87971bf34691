//! The same property tests against both stores: every decision and settlement of a random
//! sequence must match a plain integer model of the limits (requests: at most `burst`
//! outstanding charges; tokens: a level in `-capacity..=capacity`, debt carried, refunds
//! capped at full; concurrency: at most `limit` leases held). The quotas refill over 1000
//! hours, so during a test run the refill is far below one request or token and the model
//! needs no clock.
//!
//! The Redis runs use the server on 127.0.0.1:6379 under a key prefix of their own, deleted
//! afterwards. Without a reachable server they are skipped with a message, unless
//! `LEVEE_REQUIRE_REDIS=1` (set by CI), where they fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::redis_store;
use levee_policy::{ManualClock, Quota, Timestamp, TokenQuota};
use levee_store::{
    Decision, LimitStore, Limited, MemoryStore, ScopeLimits, Settlement, SliceDecision,
};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;

const SLOW: Duration = Duration::from_secs(1000 * 3600);

#[derive(Debug, Clone)]
enum Op {
    Take(u64),
    /// Settle the n-th open grant (mod the number open) with this many tokens used.
    Reconcile(usize, u64),
    Refund(usize),
    /// Ask for a slice of at most this many requests and tokens, at least this many tokens.
    Slice(u64, u64, u64),
    /// Give the n-th open slice back unused.
    ReturnSlice(usize),
}

fn op(cap: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..=cap + cap / 4).prop_map(Op::Take),
        2 => (any::<usize>(), 0..=cap * 2).prop_map(|(i, a)| Op::Reconcile(i, a)),
        1 => any::<usize>().prop_map(Op::Refund),
        1 => (1u64..6, 0..=cap, 0..=cap / 2).prop_map(|(r, t, m)| Op::Slice(r, t.max(m), m)),
        1 => any::<usize>().prop_map(Op::ReturnSlice),
    ]
}

/// The model of one scope.
#[derive(Debug, Clone)]
struct Model {
    burst: Option<u64>,
    cap: Option<u64>,
    conc: Option<u64>,
    used: u64,
    level: i64,
    held: u64,
}

impl Model {
    fn new(burst: Option<u64>, cap: Option<u64>, conc: Option<u64>) -> Self {
        Model {
            burst,
            cap,
            conc,
            used: 0,
            level: cap.map_or(0, |c| c as i64),
            held: 0,
        }
    }
    fn check(&self, tokens: u64) -> Option<Limited> {
        if let Some(c) = self.conc {
            if self.held >= c {
                return Some(Limited::Concurrency);
            }
        }
        if let Some(b) = self.burst {
            if self.used >= b {
                return Some(Limited::Requests);
            }
        }
        if let Some(c) = self.cap {
            if tokens > c {
                return Some(Limited::TooLarge { capacity: c });
            }
            if self.level < tokens as i64 {
                return Some(Limited::Tokens);
            }
        }
        None
    }
    fn take(&mut self, tokens: u64) {
        if self.conc.is_some() {
            self.held += 1;
        }
        if self.burst.is_some() {
            self.used += 1;
        }
        if self.cap.is_some() {
            self.level -= tokens as i64;
        }
    }
    fn settle(&mut self, s: Settlement, leased: bool) {
        if leased && self.conc.is_some() {
            self.held -= 1;
        }
        if self.burst.is_some() {
            self.used = self.used.saturating_sub(s.give_back_requests);
        }
        if let Some(c) = self.cap {
            let c = c as i64;
            let diff = s.reserved as i64 - s.actual as i64;
            self.level = if diff >= 0 {
                (self.level + diff).min(c)
            } else {
                (self.level + diff).max(-c)
            };
        }
    }
}

fn scope(id: String, burst: Option<u64>, cap: Option<u64>, conc: Option<u64>) -> ScopeLimits {
    ScopeLimits {
        id: Arc::from(id),
        requests: burst.map(|b| Quota::new(b, SLOW).with_burst(b)),
        tokens: cap.map(|c| TokenQuota::new(c, SLOW)),
        concurrency: conc,
    }
}

/// Runs `ops` against `store` and the model; returns the first disagreement.
async fn check_store<S: LimitStore>(
    store: &S,
    scopes: &[ScopeLimits],
    mut models: Vec<Model>,
    ops: &[Op],
) -> Result<(), String> {
    let mut open: Vec<(u64, String)> = Vec::new();
    let mut slices: Vec<(u64, u64)> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Take(tokens) => {
                let want = models
                    .iter()
                    .enumerate()
                    .find_map(|(i, m)| m.check(*tokens).map(|l| (i, l)));
                let lease = format!("lease-{step}");
                let got = store
                    .take(scopes, *tokens, &lease)
                    .await
                    .map_err(|e| e.to_string())?;
                match (want, got) {
                    (None, Decision::Admitted(fig)) => {
                        for m in &mut models {
                            m.take(*tokens);
                        }
                        open.push((*tokens, lease));
                        let last = models.last().unwrap();
                        if let (Some(b), Some(r)) = (last.burst, fig.requests) {
                            if r.remaining != b - last.used {
                                return Err(format!(
                                    "step {step}: requests remaining {} != model {}",
                                    r.remaining,
                                    b - last.used
                                ));
                            }
                        }
                        if let (Some(_), Some(t)) = (last.cap, fig.tokens) {
                            let want = last.level.max(0) as u64;
                            if t.remaining != want {
                                return Err(format!(
                                    "step {step}: tokens remaining {} != model {want}",
                                    t.remaining
                                ));
                            }
                        }
                    }
                    (
                        Some((i, l)),
                        Decision::Refused {
                            scope,
                            limit,
                            retry_after,
                        },
                    ) => {
                        if (i, l) != (scope, limit) {
                            return Err(format!(
                                "step {step}: refused by {scope}/{limit:?}, model says {i}/{l:?}"
                            ));
                        }
                        let timed = matches!(l, Limited::Requests | Limited::Tokens);
                        if timed && retry_after.is_zero() {
                            return Err(format!("step {step}: refusal without a wait"));
                        }
                    }
                    (want, got) => {
                        return Err(format!(
                            "step {step}: take({tokens}) gave {got:?}, model {want:?}"
                        ))
                    }
                }
            }
            Op::Reconcile(i, _) | Op::Refund(i) if !open.is_empty() => {
                let (reserved, lease) = open.remove(i % open.len());
                let s = match op {
                    Op::Reconcile(_, a) => Settlement::reconcile(reserved, *a),
                    _ => Settlement::refund(reserved),
                };
                store
                    .settle(scopes, s, &lease)
                    .await
                    .map_err(|e| e.to_string())?;
                for m in &mut models {
                    m.settle(s, true);
                }
            }
            Op::Slice(r, t, min) => {
                // The model: as much as every scope has, or a refusal by the first scope
                // short of one request and `min` tokens.
                let mut want: Result<(u64, u64), (usize, Limited)> = Ok((*r, *t));
                for (i, m) in models.iter().enumerate() {
                    let Ok((gr, gt)) = want else { break };
                    let mut gr2 = gr;
                    let mut gt2 = gt;
                    if let Some(b) = m.burst {
                        if m.used >= b {
                            want = Err((i, Limited::Requests));
                            continue;
                        }
                        gr2 = gr2.min(b - m.used);
                    }
                    if let Some(c) = m.cap {
                        if *min > c {
                            want = Err((i, Limited::TooLarge { capacity: c }));
                            continue;
                        }
                        // In debt, even zero tokens are refused (as `take` does).
                        if m.level < *min as i64 {
                            want = Err((i, Limited::Tokens));
                            continue;
                        }
                        gt2 = gt2.min(m.level as u64);
                    }
                    want = Ok((gr2, gt2));
                }
                let got = store
                    .take_slice(scopes, *r, *t, *min)
                    .await
                    .map_err(|e| e.to_string())?;
                match (want, got) {
                    (Ok((gr, gt)), SliceDecision::Granted(g))
                        if (g.requests, g.tokens) == (gr, gt) =>
                    {
                        for m in &mut models {
                            if m.burst.is_some() {
                                m.used += gr;
                            }
                            if m.cap.is_some() {
                                m.level -= gt as i64;
                            }
                        }
                        slices.push((gr, gt));
                    }
                    (Err((i, l)), SliceDecision::Refused { scope, limit, .. })
                        if (i, l) == (scope, limit) => {}
                    (want, got) => {
                        return Err(format!(
                            "step {step}: slice({r}, {t}, {min}) gave {got:?}, model {want:?}"
                        ))
                    }
                }
            }
            Op::ReturnSlice(i) if !slices.is_empty() => {
                let (gr, gt) = slices.remove(i % slices.len());
                let s = Settlement::unused(gr, gt);
                store
                    .settle(scopes, s, "")
                    .await
                    .map_err(|e| e.to_string())?;
                for m in &mut models {
                    m.settle(s, false);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

type Limits = (
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<u64>,
);

fn limits_strategy() -> impl Strategy<Value = Limits> {
    (
        prop::option::weighted(0.5, 1u64..6),
        prop::option::weighted(0.5, 10u64..200),
        prop::option::weighted(0.8, 1u64..8),
        prop::option::weighted(0.8, 10u64..200),
        prop::option::weighted(0.5, 1u64..5),
    )
}

fn case((gb, gc, tb, tc, conc): Limits, n: u32) -> (Vec<ScopeLimits>, Vec<Model>) {
    (
        vec![
            scope(format!("global-{n}"), gb, gc, None),
            scope(format!("t:tenant-{n}"), tb, tc, conc),
        ],
        vec![Model::new(gb, gc, None), Model::new(tb, tc, conc)],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn memory_store_matches_the_model(
        limits in limits_strategy(),
        ops in prop::collection::vec(op(200), 1..60),
    ) {
        let store = MemoryStore::new(ManualClock::starting_at(Timestamp::from_nanos(1)));
        let (scopes, models) = case(limits, 0);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let r = rt.block_on(check_store(&store, &scopes, models, &ops));
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn redis_store_matches_the_model() {
    let Some((rt, store)) = redis_store("model") else {
        return;
    };
    let n = std::cell::Cell::new(0u32);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 128,
        ..ProptestConfig::default()
    });
    let result = runner.run(
        &(limits_strategy(), prop::collection::vec(op(200), 1..60)),
        |(limits, ops)| {
            // Fresh keys per case: a case never sees another's state.
            n.set(n.get() + 1);
            let (scopes, models) = case(limits, n.get());
            let r = rt.block_on(check_store(&store, &scopes, models, &ops));
            prop_assert!(r.is_ok(), "{}", r.unwrap_err());
            Ok(())
        },
    );
    let cleared = rt.block_on(store.clear());
    result.unwrap();
    cleared.unwrap();
}

/// A lease its replica stops renewing (the replica died) frees itself; one that is renewed
/// holds past its lifetime.
#[test]
fn redis_leases_expire_unless_renewed() {
    let Some((rt, store)) = redis_store("lease") else {
        return;
    };
    // Renewed every eighth of a lifetime: a stall of most of a lifetime is tolerated.
    let ttl = Duration::from_millis(1000);
    let store = store.with_lease_ttl(ttl);
    let one = [scope("t:lease".into(), None, None, Some(1))];
    rt.block_on(async {
        assert!(matches!(
            store.take(&one, 1, "held").await.unwrap(),
            Decision::Admitted(_)
        ));
        // Renewed for two lifetimes: still held.
        let started = std::time::Instant::now();
        while started.elapsed() < ttl * 2 {
            store
                .renew(&[(one[0].id.clone(), "held".into())])
                .await
                .unwrap();
            tokio::time::sleep(ttl / 8).await;
        }
        assert!(matches!(
            store.take(&one, 1, "second").await.unwrap(),
            Decision::Refused {
                limit: Limited::Concurrency,
                ..
            }
        ));
        // No longer renewed (its replica died): freed within about a lifetime. Bounded poll.
        let stopped = std::time::Instant::now();
        let freed = loop {
            if let Decision::Admitted(_) = store.take(&one, 1, "third").await.unwrap() {
                break stopped.elapsed();
            }
            assert!(stopped.elapsed() < ttl * 10, "the lease never expired");
            tokio::time::sleep(ttl / 8).await;
        };
        assert!(
            freed + ttl / 4 >= ttl / 2,
            "freed after {freed:?}, lifetime {ttl:?}"
        );
        store.clear().await.unwrap();
    });
}

/// The backend-budget lease script against levee-policy's rule: random renewals of three
/// replicas' slices of one backend give each the grant the pure model computes (max-min
/// fair share of the wants, within what the others hold), and the holdings never add up to
/// more than the budget.
#[test]
fn redis_backend_leases_match_the_model() {
    use levee_policy::{fair_split, Budget};
    let Some((rt, store)) = redis_store("fleet") else {
        return;
    };
    let lease = Duration::from_secs(60);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        ..ProptestConfig::default()
    });
    let n = std::cell::Cell::new(0u32);
    let result = runner.run(
        &(
            1u64..30,
            100u64..5_000,
            prop::collection::vec((0usize..3, 0u64..40, 0u64..40), 1..40),
        ),
        |(slots, kv, ops)| {
            n.set(n.get() + 1);
            let backend = format!("m@b{}", n.get());
            let budget = Budget {
                slots,
                kv_tokens: kv,
            };
            // Per replica: held, want (slots; kv scaled ×100).
            let mut held = [(0u64, 0u64); 3];
            let mut wants = [(0u64, 0u64); 3];
            let mut allowed = [(0u64, 0u64); 3];
            for (r, w, used) in ops {
                let want = Budget {
                    slots: w.min(slots),
                    kv_tokens: (w * 100).min(kv),
                };
                // What it has in flight: never more than its last allowance.
                let in_flight = Budget {
                    slots: used.min(allowed[r].0),
                    kv_tokens: (used * 100).min(allowed[r].1),
                };
                let g = rt
                    .block_on(store.lease_backend(
                        &backend,
                        &format!("r{r}"),
                        lease,
                        budget,
                        &[want],
                        in_flight,
                    ))
                    .unwrap();
                wants[r] = (want.slots, want.kv_tokens);
                let others = |f: fn(&(u64, u64)) -> u64| -> u64 {
                    held.iter()
                        .enumerate()
                        .filter(|(j, _)| *j != r)
                        .map(|(_, h)| f(h))
                        .sum()
                };
                let model = |k: usize, total: u64, other: u64| {
                    let ws: Vec<u64> = wants
                        .iter()
                        .enumerate()
                        .filter(|(j, w)| *j == r || **w != (0, 0))
                        .map(|(_, w)| if k == 0 { w.0 } else { w.1 })
                        .collect();
                    let me = wants
                        .iter()
                        .enumerate()
                        .filter(|(j, w)| *j == r || **w != (0, 0))
                        .position(|(j, _)| j == r)
                        .unwrap();
                    fair_split(&ws, total)[me].min(total.saturating_sub(other))
                };
                let want_s = model(0, slots, others(|h| h.0));
                let want_k = model(1, kv, others(|h| h.1));
                prop_assert_eq!(g.allowed.slots, want_s);
                prop_assert_eq!(g.allowed.kv_tokens, want_k);
                prop_assert_eq!(g.others.slots, others(|h| h.0));
                allowed[r] = (g.allowed.slots, g.allowed.kv_tokens);
                held[r] = (
                    g.allowed.slots.max(in_flight.slots),
                    g.allowed.kv_tokens.max(in_flight.kv_tokens),
                );
                if want == Budget::default() && in_flight == Budget::default() {
                    held[r] = (0, 0);
                }
                let total: u64 = held.iter().map(|h| h.0).sum();
                let total_kv: u64 = held.iter().map(|h| h.1).sum();
                prop_assert!(total <= slots && total_kv <= kv, "held {total}/{total_kv}");
            }
            Ok(())
        },
    );
    let cleared = rt.block_on(store.clear());
    result.unwrap();
    cleared.unwrap();
}

/// A replica that stops renewing (it died) holds its slice only until the lease ends; then
/// the others get the whole budget.
#[test]
fn redis_backend_slices_of_a_dead_replica_come_back_after_the_lease() {
    use levee_policy::Budget;
    let Some((rt, store)) = redis_store("fleet-dead") else {
        return;
    };
    let lease = Duration::from_millis(400);
    let budget = Budget {
        slots: 10,
        kv_tokens: 1_000,
    };
    rt.block_on(async {
        let lease_for = |r: &'static str| {
            let store = store.clone();
            async move {
                store
                    .lease_backend("m@b", r, lease, budget, &[budget], Budget::default())
                    .await
                    .unwrap()
            }
        };
        let dead = lease_for("dead").await;
        assert_eq!(dead.allowed, budget, "alone, it gets the budget");
        let live = lease_for("live").await;
        assert_eq!(live.allowed, Budget::default(), "nothing is free yet");
        assert_eq!(live.others, budget);
        assert_eq!(live.replicas, 2);
        // "dead" renews no more; "live" renews until the lease has passed.
        let started = std::time::Instant::now();
        let got = loop {
            let g = lease_for("live").await;
            if g.allowed == budget {
                break started.elapsed();
            }
            assert!(started.elapsed() < lease * 10, "the slice never came back");
            tokio::time::sleep(lease / 8).await;
        };
        assert!(
            got + lease / 4 >= lease / 2,
            "back after {got:?}, lease {lease:?}"
        );
        // A clean return frees at once.
        store
            .lease_backend("m@b", "live", lease, budget, &[], Budget::default())
            .await
            .unwrap();
        let again = lease_for("dead").await;
        assert_eq!(again.allowed, budget);
        store.clear().await.unwrap();
    });
}
