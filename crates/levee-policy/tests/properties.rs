//! Property tests for levee-policy's guarantees (issue 2, "Done means").
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

fn ts(ns: u64) -> Timestamp {
    Timestamp::from_nanos(ns)
}

// ---------------------------------------------------------------------------------------
// GCRA: never more than ⌊t·count/period⌋ + burst in any window of length t.

proptest! {
    #[test]
    fn gcra_never_exceeds_rate_times_t_plus_burst(
        count in 1u64..50,
        period_ms in 1u64..5_000,
        burst in 1u64..20,
        gaps in prop::collection::vec(0u64..200_000_000, 1..300),
    ) {
        let q = Quota::new(count, Duration::from_millis(period_ms)).with_burst(burst);
        let period_ns = period_ms as u128 * 1_000_000;
        let mut g = Gcra::new(q);
        let mut now = 1_000u64;
        let mut admitted: Vec<u64> = Vec::new();
        for gap in gaps {
            now += gap;
            match g.check(ts(now)) {
                Ok(()) => admitted.push(now),
                Err(e) => {
                    // The promised wait is exact: one tick earlier is refused, at it admitted.
                    let mut probe = g.clone();
                    let at = ts(now) + e.retry_after;
                    prop_assert!(probe.check(at).is_ok(), "not admitted after retry_after");
                    if e.retry_after > Duration::from_nanos(1) {
                        let mut early = g.clone();
                        prop_assert!(early.check(at.saturating_sub(Duration::from_nanos(1))).is_err());
                    }
                }
            }
        }
        // Every window between two admissions (the worst windows start and end on one).
        for i in 0..admitted.len() {
            for j in i..admitted.len() {
                let t = (admitted[j] - admitted[i]) as u128;
                let allowed = t * count as u128 / period_ns + burst as u128;
                prop_assert!((j - i + 1) as u128 <= allowed,
                    "{} admitted in {} ns, allowed {}", j - i + 1, t, allowed);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Token bucket: reservations and reconciliations keep the level within [0, capacity].

#[derive(Debug, Clone)]
enum TokOp {
    Reserve(u64),
    Reconcile { pick: usize, actual: u64 },
    Advance(u64),
}

fn tok_op() -> impl Strategy<Value = TokOp> {
    prop_oneof![
        (0u64..3_000).prop_map(TokOp::Reserve),
        (any::<usize>(), 0u64..6_000).prop_map(|(pick, actual)| TokOp::Reconcile { pick, actual }),
        (0u64..2_000_000_000).prop_map(TokOp::Advance),
    ]
}

proptest! {
    #[test]
    fn token_bucket_stays_within_zero_and_capacity(
        tpm in 1u64..100_000,
        capacity in 1u64..5_000,
        ops in prop::collection::vec(tok_op(), 1..200),
    ) {
        let mut b = TokenBucket::new(TokenQuota::per_minute(tpm).with_capacity(capacity));
        let mut now = 7u64;
        let mut outstanding: Vec<u64> = Vec::new();
        for op in ops {
            match op {
                TokOp::Reserve(n) => {
                    let before = b.available(ts(now));
                    match b.reserve(n, ts(now)) {
                        Ok(()) => {
                            prop_assert!(n <= before, "reserved {n} with {before} available");
                            outstanding.push(n);
                        }
                        Err(Refused::TooLarge { capacity: c }) => prop_assert!(n > c),
                        Err(Refused::NotUntil { retry_after }) => {
                            // More than is there, or the bucket is in debt.
                            prop_assert!(n > before || before == 0);
                            let mut probe = b.clone();
                            prop_assert!(probe.reserve(n, ts(now) + retry_after).is_ok());
                        }
                    }
                }
                TokOp::Reconcile { pick, actual } => {
                    if !outstanding.is_empty() {
                        let r = outstanding.swap_remove(pick % outstanding.len());
                        b.reconcile(r, actual, ts(now));
                    }
                }
                TokOp::Advance(d) => now += d,
            }
            let (debt, cap) = b.debt_units(ts(now));
            // Overage is carried as debt, at most one capacity below zero.
            prop_assert!(debt <= 2 * cap, "more than one capacity below zero: debt {debt} > 2 × {cap}");
            prop_assert!(b.available(ts(now)) <= capacity);
        }
    }

    #[test]
    fn keyed_token_limiter_stays_bounded(
        keys in prop::collection::vec((0u32..500, 0u64..2_000, 0u64..4_000), 1..300),
    ) {
        let mut l: TokenLimiter<u32> = TokenLimiter::new(Some(TokenQuota::per_minute(1000)), 64);
        let mut now = 1u64;
        for (k, est, actual) in keys {
            now += 1_000_000;
            if let Ok(r) = l.reserve(&k, est, ts(now)) {
                l.reconcile(r, actual, ts(now));
            }
            prop_assert!(l.tracked_keys() <= 64);
            if let Some(b) = l.bucket(&k) {
                let (debt, cap) = b.debt_units(ts(now));
                prop_assert!(debt <= 2 * cap);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// FairQueue against a reference model: bounds, strict priority, FIFO per tenant, exact
// expiry and cancellation.

#[derive(Debug, Clone)]
enum QOp {
    Push {
        tier: u8,
        tenant: u8,
        cost: u64,
        ttl: Option<u64>,
    },
    Pop,
    Cancel(usize),
    Expire,
    Advance(u64),
}

fn q_op() -> impl Strategy<Value = QOp> {
    prop_oneof![
        4 => (0u8..3, 0u8..4, 0u64..400, prop::option::of(1u64..1_000))
            .prop_map(|(tier, tenant, cost, ttl)| QOp::Push { tier, tenant, cost, ttl }),
        3 => Just(QOp::Pop),
        1 => any::<usize>().prop_map(QOp::Cancel),
        1 => Just(QOp::Expire),
        1 => (0u64..300).prop_map(QOp::Advance),
    ]
}

#[derive(Debug, Clone)]
struct Live {
    ticket: Ticket,
    tier: u8,
    tenant: u8,
    cost: u64,
    seq: u64,
    deadline: Timestamp,
}

proptest! {
    #[test]
    fn queue_bounds_priority_fifo_expiry(
        max_len in 1usize..20,
        max_tokens in 0u64..3_000,
        ops in prop::collection::vec(q_op(), 1..300),
    ) {
        let mut q: FairQueue<u64, u8> = FairQueue::new(QueueLimits { tiers: 3, max_len, max_tokens });
        q.set_weight(&1, 2);
        q.set_weight(&3, 5);
        let mut live: Vec<Live> = Vec::new();
        let mut seq = 0u64;
        let mut now = 0u64;
        for op in ops {
            match op {
                QOp::Push { tier, tenant, cost, ttl } => {
                    let deadline = match ttl { Some(t) => ts(now + t), None => Timestamp::MAX };
                    let tokens: u64 = live.iter().map(|l| l.cost).sum();
                    let expect = if live.len() >= max_len {
                        Err(PushRefusal::QueueFull)
                    } else if tokens + cost > max_tokens {
                        Err(PushRefusal::TokensFull)
                    } else {
                        Ok(())
                    };
                    match q.push(Tier(tier), tenant, cost, ts(now), deadline, seq) {
                        Ok(ticket) => {
                            prop_assert_eq!(expect, Ok(()));
                            live.push(Live { ticket, tier, tenant, cost, seq, deadline });
                        }
                        Err(r) => {
                            prop_assert_eq!(expect, Err(r.reason));
                            prop_assert_eq!(r.item, seq);
                        }
                    }
                    seq += 1;
                }
                QOp::Pop => match q.pop() {
                    None => prop_assert!(live.is_empty()),
                    Some(e) => {
                        let min_tier = live.iter().map(|l| l.tier).min();
                        // Nobody waits behind a lower-priority request.
                        prop_assert_eq!(Some(e.tier.0), min_tier);
                        // FIFO inside a tenant (and tier).
                        let oldest = live.iter()
                            .filter(|l| l.tier == e.tier.0 && l.tenant == e.tenant)
                            .map(|l| l.seq).min();
                        prop_assert_eq!(Some(e.item), oldest);
                        live.retain(|l| l.seq != e.item);
                    }
                },
                QOp::Cancel(pick) => {
                    if !live.is_empty() {
                        let l = live.swap_remove(pick % live.len());
                        let e = q.cancel(l.ticket);
                        prop_assert_eq!(e.map(|e| e.item), Some(l.seq));
                        prop_assert!(q.cancel(l.ticket).is_none());
                    }
                }
                QOp::Expire => {
                    let mut got: Vec<u64> = q.expire(ts(now)).into_iter().map(|e| e.item).collect();
                    let mut want: Vec<u64> =
                        live.iter().filter(|l| l.deadline <= ts(now)).map(|l| l.seq).collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    prop_assert_eq!(got, want);
                    live.retain(|l| l.deadline > ts(now));
                }
                QOp::Advance(d) => now += d,
            }
            prop_assert!(q.len() <= max_len);
            prop_assert!(q.queued_tokens() <= max_tokens);
            prop_assert_eq!(q.len(), live.len());
            prop_assert_eq!(q.queued_tokens(), live.iter().map(|l| l.cost).sum::<u64>());
            let st = q.stats();
            for t in 0..3u8 {
                prop_assert_eq!(st.tiers[t as usize].len, live.iter().filter(|l| l.tier == t).count());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// VTC bound: between two tenants of one tier, both backlogged over an interval, the weighted
// service difference |ΔS_f/w_f − ΔS_g/w_g| ≤ 2·U with U = max cost/weight of any request.

#[derive(Debug, Clone)]
enum VOp {
    Push { tenant: u8, cost: u64 },
    Pop,
}

fn v_op() -> impl Strategy<Value = VOp> {
    prop_oneof![
        3 => (0u8..3, 1u64..1_000).prop_map(|(tenant, cost)| VOp::Push { tenant, cost }),
        2 => Just(VOp::Pop),
    ]
}

proptest! {
    #[test]
    fn vtc_service_difference_within_bound(
        weights in prop::collection::vec(1u32..5, 3),
        ops in prop::collection::vec(v_op(), 1..400),
    ) {
        let mut q: FairQueue<u64, u8> =
            FairQueue::new(QueueLimits { tiers: 1, max_len: 10_000, max_tokens: u64::MAX });
        for (t, w) in weights.iter().enumerate() {
            q.set_weight(&(t as u8), *w);
        }
        let mut u: f64 = 0.0;
        // Snapshot after each op: weighted service so far and backlog per tenant.
        let mut served = [0f64; 3];
        let mut snaps: Vec<([f64; 3], [bool; 3])> = Vec::new();
        for op in ops {
            match op {
                VOp::Push { tenant, cost } => {
                    u = u.max(cost as f64 / weights[tenant as usize] as f64);
                    q.push(Tier(0), tenant, cost, Timestamp::ZERO, Timestamp::MAX, cost).unwrap();
                }
                VOp::Pop => {
                    if let Some(e) = q.pop() {
                        served[e.tenant as usize] += e.cost as f64 / weights[e.tenant as usize] as f64;
                    }
                }
            }
            let mut backlogged = [false; 3];
            for t in 0..3u8 {
                backlogged[t as usize] = !q.tenant_backlog(&t).is_empty();
            }
            snaps.push((served, backlogged));
        }
        let bound = 2.0 * u + 1e-6;
        for f in 0..3 {
            for g in (f + 1)..3 {
                for i in 0..snaps.len() {
                    for j in i..snaps.len() {
                        if !(snaps[j].1[f] && snaps[j].1[g]) {
                            break; // the interval must keep both backlogged
                        }
                        let df = snaps[j].0[f] - snaps[i].0[f];
                        let dg = snaps[j].0[g] - snaps[i].0[g];
                        prop_assert!((df - dg).abs() <= bound,
                            "tenants {f},{g} over snaps {i}..{j}: {df} vs {dg}, bound {bound}");
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Breaker: model-based test against a reference state machine written from the spec.

#[derive(Debug, Clone, Copy, PartialEq)]
enum RefState {
    Closed,
    Open { until: u64 },
    HalfOpen { in_flight: u32, successes: u32 },
}

struct RefBreaker {
    cfg: BreakerConfig,
    bucket_ns: u64,
    state: RefState,
    generation: u64,
    events: Vec<(u64, bool)>,
    consecutive: u32,
    opened: u64,
}

impl RefBreaker {
    fn new(cfg: BreakerConfig) -> Self {
        let bucket_ns = (cfg.window.as_nanos() as u64 / cfg.buckets as u64).max(1);
        RefBreaker {
            cfg,
            bucket_ns,
            state: RefState::Closed,
            generation: 0,
            events: vec![],
            consecutive: 0,
            opened: 0,
        }
    }
    fn go(&mut self, s: RefState) {
        self.generation += 1;
        if matches!(s, RefState::Open { .. }) {
            self.opened += 1;
        }
        self.state = s;
        self.events.clear();
        self.consecutive = 0;
    }
    fn view(&self, now: u64) -> BreakerState {
        match self.state {
            RefState::Closed => BreakerState::Closed,
            RefState::Open { until } if now < until => BreakerState::Open,
            _ => BreakerState::HalfOpen,
        }
    }
    /// Some((generation, probe)) if admitted.
    fn acquire(&mut self, now: u64) -> Option<(u64, bool)> {
        if let RefState::Open { until } = self.state {
            if now < until {
                return None;
            }
            self.go(RefState::HalfOpen {
                in_flight: 0,
                successes: 0,
            });
        }
        match self.state {
            RefState::Closed => Some((self.generation, false)),
            RefState::HalfOpen {
                in_flight,
                successes,
            } if in_flight < self.cfg.half_open_probes => {
                self.state = RefState::HalfOpen {
                    in_flight: in_flight + 1,
                    successes,
                };
                Some((self.generation, true))
            }
            _ => None,
        }
    }
    fn record(&mut self, generation: u64, outcome: Outcome, now: u64) {
        if generation != self.generation {
            return;
        }
        match self.state {
            RefState::Open { .. } => {}
            RefState::HalfOpen {
                in_flight,
                successes,
            } => match outcome {
                Outcome::Success if successes + 1 >= self.cfg.success_threshold => {
                    self.go(RefState::Closed)
                }
                Outcome::Success => {
                    self.state = RefState::HalfOpen {
                        in_flight: in_flight - 1,
                        successes: successes + 1,
                    }
                }
                Outcome::BackendFailure => {
                    let until = now + self.cfg.cooldown.as_nanos() as u64;
                    self.go(RefState::Open { until });
                }
                _ => {
                    self.state = RefState::HalfOpen {
                        in_flight: in_flight - 1,
                        successes,
                    }
                }
            },
            RefState::Closed => {
                let failed = match outcome {
                    Outcome::Success => false,
                    Outcome::BackendFailure => true,
                    _ => return,
                };
                self.events.push((now, failed));
                if !failed {
                    self.consecutive = 0;
                    return;
                }
                self.consecutive += 1;
                let cur = now / self.bucket_ns;
                let in_window: Vec<bool> = self
                    .events
                    .iter()
                    .filter(|(t, _)| cur - t / self.bucket_ns < self.cfg.buckets as u64)
                    .map(|(_, f)| *f)
                    .collect();
                let total = in_window.len() as u64;
                let failures = in_window.iter().filter(|f| **f).count() as u64;
                let by_consecutive = self.cfg.consecutive_failures > 0
                    && self.consecutive >= self.cfg.consecutive_failures;
                let by_rate = total >= self.cfg.min_requests as u64
                    && failures as f64 >= self.cfg.failure_rate * total as f64;
                if by_consecutive || by_rate {
                    let until = now + self.cfg.cooldown.as_nanos() as u64;
                    self.go(RefState::Open { until });
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum BOp {
    Acquire,
    Record { pick: usize, outcome: u8 },
    Advance(u64),
}

fn b_op() -> impl Strategy<Value = BOp> {
    prop_oneof![
        3 => Just(BOp::Acquire),
        4 => (any::<usize>(), 0u8..10).prop_map(|(pick, outcome)| BOp::Record { pick, outcome }),
        2 => (0u64..3_000_000_000).prop_map(BOp::Advance),
    ]
}

fn outcome_of(n: u8) -> Outcome {
    match n {
        0..=3 => Outcome::Success,
        4..=6 => Outcome::BackendFailure,
        7 => Outcome::Backpressure,
        8 => Outcome::ClientError,
        _ => Outcome::Cancelled,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn breaker_follows_reference_state_machine(
        min_requests in 1u32..8,
        rate_pct in 10u32..100,
        consecutive in 0u32..5,
        probes in 1u32..3,
        successes in 1u32..3,
        ops in prop::collection::vec(b_op(), 1..300),
    ) {
        let cfg = BreakerConfig {
            window: Duration::from_secs(4),
            buckets: 4,
            min_requests,
            failure_rate: rate_pct as f64 / 100.0,
            consecutive_failures: consecutive,
            cooldown: Duration::from_secs(2),
            half_open_probes: probes,
            success_threshold: successes,
        };
        let mut b = Breaker::new(cfg);
        let mut m = RefBreaker::new(cfg);
        let mut now = 1u64;
        let mut tickets: Vec<(BreakerTicket, u64)> = Vec::new();
        for op in ops {
            match op {
                BOp::Acquire => {
                    let got = b.try_acquire(ts(now));
                    let want = m.acquire(now);
                    match (got, want) {
                        (Ok(t), Some((generation, probe))) => {
                            prop_assert_eq!(t.is_probe(), probe);
                            tickets.push((t, generation));
                        }
                        (Err(e), None) => prop_assert!(e.retry_after >= Duration::from_millis(1)),
                        (got, want) => prop_assert!(false, "acquire differs: {:?} vs {:?}", got, want),
                    }
                }
                BOp::Record { pick, outcome } => {
                    if !tickets.is_empty() {
                        let (t, generation) = tickets.swap_remove(pick % tickets.len());
                        let o = outcome_of(outcome);
                        b.record(t, o, ts(now));
                        m.record(generation, o, now);
                    }
                }
                BOp::Advance(d) => now += d,
            }
            prop_assert_eq!(b.state(ts(now)), m.view(now));
            prop_assert_eq!(b.stats(ts(now)).opened_total, m.opened);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Admission on the path the gateway runs: whatever the request sizes and the order of
// arrivals, completions, expiries and reports, no backend ever holds more KV tokens than its
// budget (less headroom) nor more requests than its cap, the queue stays within its bounds,
// and the books balance (every grant the test holds is counted in flight, nothing else).

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn admission_keeps_every_backend_within_its_kv_budget(
        ops in prop::collection::vec((0u8..6, 0u8..4, 1u64..3_500, 0u64..50_000_000), 1..300),
    ) {
        let mut cfg = AdmissionConfig::new();
        cfg.tenant_default = LimitSpec { requests_per_minute: Some(6_000), tokens_per_minute: Some(2_000_000), max_concurrent: Some(12), ..LimitSpec::UNLIMITED };
        let mut a: Admission<u32, u8> = Admission::new(cfg);
        let mut lane = LaneConfig::new(Watermarks { safe: 8, soft: 16, hard: 24 });
        lane.queue_max_len = 10;
        lane.queue_max_tokens = 20_000;
        lane.kv_headroom = 0.1;
        a.set_model(0, ModelSpec { limits: LimitSpec::UNLIMITED, lane });
        let budgets = [4_000u64, 7_000];
        a.set_backends(&0, vec![
            (Arc::from("b0"), BackendLimits { max_in_flight: 4, kv_tokens: Some(budgets[0]) }),
            (Arc::from("b1"), BackendLimits { max_in_flight: 6, kv_tokens: Some(budgets[1]) }),
        ]);
        let mut in_flight: HashMap<u32, Grant<u8>> = HashMap::new();
        let mut now = 1u64;
        let mut id = 0u32;
        for (kind, tenant, size, dt) in ops {
            now += dt;
            id += 1;
            match kind {
                0..=2 => {
                    let req = AdmissionRequest { tenant, model: 0, tier: Tier(tenant % 3), prompt_tokens: size / 2, completion_tokens: size - size / 2, max_wait: None, session: None, answered_at_end: false };
                    if let Admit::Dispatch(d) = a.admit(&req, id, ts(now)) {
                        in_flight.insert(d.item, d.grant);
                    }
                }
                3 => {
                    if let Some(k) = in_flight.keys().next().copied() {
                        if let Some(g) = in_flight.remove(&k) {
                            let done = Completion { outcome: Outcome::Success, actual_tokens: Some(size), generated: None };
                            a.complete(g, done, ts(now));
                        }
                    }
                }
                4 => {
                    let report = BackendReport { running: 1.0, waiting: 0.0, kv_usage: Some((size % 100) as f64 / 100.0) };
                    a.report(&0, if size % 2 == 0 { "b0" } else { "b1" }, report, ts(now));
                }
                _ => {
                    let _ = a.expire(&0, ts(now));
                }
            }
            while let Some(d) = a.dequeue(&0, ts(now)) {
                in_flight.insert(d.item, d.grant);
            }
            let lane = a.lane(&0).unwrap();
            for (st, budget) in lane.backend_stats(ts(now)).iter().zip(budgets) {
                let usable = (budget as f64 * 0.9).floor() as u64;
                prop_assert!(st.tokens_in_flight <= usable, "{} holds {} > {usable}", st.id, st.tokens_in_flight);
                let cap = if &*st.id == "b0" { 4 } else { 6 };
                prop_assert!(st.in_flight <= cap, "{} runs {} > {cap}", st.id, st.in_flight);
            }
            prop_assert_eq!(lane.in_flight(), in_flight.len());
            let q = lane.queue_stats();
            prop_assert!(q.len <= 10);
            prop_assert!(q.tokens <= 20_000);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Bounded tenant state never loosens a tenant's concurrency limit: state that live permits
// point at is pinned, so a flood of other tenants cannot reset it.

proptest! {
    #[test]
    fn tenant_concurrency_survives_key_churn(
        ops in prop::collection::vec((0u16..200, any::<bool>()), 1..400),
    ) {
        let mut cfg = AdmissionConfig::new();
        cfg.max_tracked_keys = 8;
        cfg.tenant_default = LimitSpec { max_concurrent: Some(1), requests_per_minute: Some(1_000), ..LimitSpec::UNLIMITED };
        let mut a: Admission<u32, u16> = Admission::new(cfg);
        a.set_model(0, ModelSpec { limits: LimitSpec::UNLIMITED, lane: LaneConfig::new(Watermarks { safe: 1_000, soft: 2_000, hard: 3_000 }) });
        a.set_backends(&0, vec![(Arc::from("b"), BackendLimits { max_in_flight: 1_000, kv_tokens: None })]);
        let mut held: HashMap<u16, Grant<u16>> = HashMap::new();
        // State is swept when a new tenant arrives, so the bound is the cap plus the most
        // tenants that held permits at once (released ones stay until the next sweep).
        let mut peak_held = 0usize;
        let mut now = 1u64;
        for (tenant, release) in ops {
            now += 1_000_000;
            if release {
                if let Some(g) = held.remove(&tenant) {
                    a.complete(g, Completion { outcome: Outcome::Success, actual_tokens: Some(1), generated: None }, ts(now));
                }
                continue;
            }
            let req = AdmissionRequest { tenant, model: 0, tier: Tier(0), prompt_tokens: 1, completion_tokens: 0, max_wait: None, session: None, answered_at_end: false };
            match a.admit(&req, 0, ts(now)) {
                Admit::Dispatch(d) => {
                    prop_assert!(!held.contains_key(&tenant), "tenant {tenant} got a second slot");
                    held.insert(tenant, d.grant);
                    peak_held = peak_held.max(held.len());
                }
                Admit::Queued { .. } => prop_assert!(false, "no queueing expected below safe"),
                Admit::Refused(r) => {
                    if r.reason == RefusalReason::Concurrency(Scope::Tenant) {
                        prop_assert!(held.contains_key(&tenant));
                    }
                }
            }
            prop_assert!(a.tracked_tenants() <= 8 + peak_held);
        }
    }
}

// ---------------------------------------------------------------------------------------
// A queued entry's position is its place in the order the queue then serves: popping
// everything from that state hands it out exactly at that place.

proptest! {
    #[test]
    fn position_of_is_the_real_pop_order(
        ops in prop::collection::vec((0u8..3, 0u8..4, 1u64..400, any::<bool>(), any::<bool>()), 1..120),
    ) {
        let mut q: FairQueue<u64, u8> =
            FairQueue::new(QueueLimits { tiers: 3, max_len: 1_000, max_tokens: u64::MAX });
        q.set_weight(&1, 2);
        q.set_weight(&3, 5);
        let mut tickets = Vec::new();
        for (i, (tier, tenant, cost, pop, cancel)) in ops.into_iter().enumerate() {
            let t = q.push(Tier(tier), tenant, cost, ts(i as u64), Timestamp::MAX, i as u64).unwrap();
            tickets.push(t);
            if pop {
                q.pop();
            }
            if cancel && tickets.len() > 2 {
                let victim = tickets[tickets.len() / 2];
                q.cancel(victim);
            }
        }
        let mut predicted: HashMap<Ticket, usize> = HashMap::new();
        for t in &tickets {
            match q.position_of(*t) {
                Some(p) => { predicted.insert(*t, p); }
                None => prop_assert!(!q.contains(*t)),
            }
        }
        let mut place = 0;
        while let Some(e) = q.pop() {
            place += 1;
            prop_assert_eq!(predicted.get(&e.ticket).copied(), Some(place), "ticket {:?}", e.ticket);
        }
        prop_assert_eq!(place, predicted.len());
    }
}

// ---------------------------------------------------------------------------------------
// Aging bound: once an entry has waited the aging horizon, every pop of its tier takes an
// entry pushed no later than it; so it leaves within (entries of its tier pushed before it
// and still queued when it became due) + 1 pops of its tier. Across tiers, strict priority.

#[derive(Debug, Clone)]
enum AOp {
    Push { tier: u8, tenant: u8, cost: u64 },
    Pop,
    Cancel(usize),
    Advance(u64),
}

fn a_op() -> impl Strategy<Value = AOp> {
    prop_oneof![
        4 => (0u8..2, 0u8..4, 1u64..500).prop_map(|(tier, tenant, cost)| AOp::Push { tier, tenant, cost }),
        3 => Just(AOp::Pop),
        1 => any::<usize>().prop_map(AOp::Cancel),
        2 => (0u64..40).prop_map(AOp::Advance),
    ]
}

proptest! {
    #[test]
    fn aging_bounds_the_wait_of_an_aged_entry(
        weights in prop::collection::vec(1u32..200, 4),
        horizon_ms in 1u64..100,
        shortest_first in any::<bool>(),
        ops in prop::collection::vec(a_op(), 1..400),
    ) {
        let mut q: FairQueue<u64, u8> =
            FairQueue::new(QueueLimits { tiers: 2, max_len: 10_000, max_tokens: u64::MAX });
        for (t, w) in weights.iter().enumerate() {
            q.set_weight(&(t as u8), *w);
        }
        q.set_aging(Some(Duration::from_millis(horizon_ms)));
        q.set_shortest_first(shortest_first);
        // (seq, tier, pushed at ms, ticket, pops of its tier allowed once due)
        let mut live: Vec<(u64, u8, u64, Ticket, Option<usize>)> = Vec::new();
        let (mut seq, mut now) = (0u64, 0u64);
        for op in ops {
            match op {
                AOp::Push { tier, tenant, cost } => {
                    let t = q.push(Tier(tier), tenant, cost, ts(now * 1_000_000), Timestamp::MAX, seq).unwrap();
                    live.push((seq, tier, now, t, None));
                    seq += 1;
                }
                AOp::Cancel(i) => {
                    if !live.is_empty() {
                        let l = live.remove(i % live.len());
                        prop_assert_eq!(q.cancel(l.3).map(|e| e.item), Some(l.0));
                    }
                }
                AOp::Advance(d) => now += d,
                AOp::Pop => {
                    // Entries that reached the horizon get their allowance: the entries of
                    // their tier pushed before them and still queued, plus themselves.
                    let snapshot: Vec<(u64, u8)> = live.iter().map(|l| (l.0, l.1)).collect();
                    for l in live.iter_mut() {
                        if l.4.is_none() && now - l.2 >= horizon_ms {
                            let before = snapshot.iter().filter(|(s, t)| *t == l.1 && *s < l.0).count();
                            l.4 = Some(before + 1);
                        }
                    }
                    let Some(e) = q.pop_ready(ts(now * 1_000_000), |_, _, _, _| Pick::Take) else {
                        prop_assert!(live.is_empty());
                        continue;
                    };
                    let min_tier = live.iter().map(|l| l.1).min();
                    prop_assert_eq!(Some(e.tier.0), min_tier);
                    for l in live.iter_mut().filter(|l| l.1 == e.tier.0 && l.4.is_some()) {
                        // A due entry is passed only by an entry pushed before it.
                        prop_assert!(e.item <= l.0, "popped {} past due {}", e.item, l.0);
                        let left = l.4.unwrap_or(0);
                        prop_assert!(left >= 1, "due entry {} overstayed its bound", l.0);
                        l.4 = Some(left - 1);
                    }
                    live.retain(|l| l.0 != e.item);
                }
            }
            prop_assert_eq!(q.len(), live.len());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Preference bound (`FairQueue::pop_ready_preferring`): whatever the ranks, and however they
// change from pop to pop, an entry with `n` entries of its tenant ahead of it when pushed
// leaves within `(n + 1) · (PREFER_PASSES + 1)` of its tenant's turns. One tenant here, so
// every pop is its turn; pushes interleave with pops.

proptest! {
    #[test]
    fn preferring_bounds_every_entrys_wait(
        ops in prop::collection::vec(prop_oneof![3 => Just(true), 2 => Just(false)], 1..400),
        seed in any::<u64>(),
        shortest_first in any::<bool>(),
    ) {
        let mut q: FairQueue<u64, u8> =
            FairQueue::new(QueueLimits { tiers: 1, max_len: 10_000, max_tokens: u64::MAX });
        q.set_shortest_first(shortest_first);
        let allowance = |ahead: usize| (ahead as u64 + 1) * (PREFER_PASSES as u64 + 1);
        // (item, pops left before it must have gone)
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut next = 0u64;
        let mut pops = 0u64;
        for push in ops {
            if push {
                let ahead = live.len();
                let cost = 1 + (next.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed) % 50;
                q.push(Tier(0), 0, cost, ts(0), Timestamp::MAX, next).unwrap();
                live.push((next, allowance(ahead)));
                next += 1;
                continue;
            }
            pops += 1;
            // Ranks drawn afresh at every pop, from the seed.
            let rank = |_: Tier, _: &u8, _: u64, item: &u64| {
                ((item.wrapping_add(pops).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ seed) % 3) as u8
            };
            let Some(e) = q.pop_ready_preferring(ts(0), rank, |_, _, _, _| Pick::Take) else {
                prop_assert!(live.is_empty());
                continue;
            };
            live.retain(|(item, _)| *item != e.item);
            for (item, left) in live.iter_mut() {
                prop_assert!(*left > 1, "entry {} overstayed its bound", item);
                *left -= 1;
            }
        }
        prop_assert_eq!(q.len(), live.len());
    }
}

// ---------------------------------------------------------------------------------------
// Affinity with bounded load: the chosen backend has room; it is the preferred one whenever
// that has room and stays within ⌈(1+ε)(L+1)c/C⌉; and it is above that bound only when no
// backend with room is within it. With equal capacities: no backend above (1+ε) × the mean
// (rounded up) while another has room.

proptest! {
    #[test]
    fn affinity_never_overloads_a_backend_while_another_has_room(
        backends in prop::collection::vec((0u64..40, 1u64..16, any::<bool>()), 1..8),
        preferred in prop::option::of(0usize..8),
        epsilon in 0.0f64..2.0,
    ) {
        let cands: Vec<Candidate> = backends
            .iter()
            .map(|&(load, capacity, room)| Candidate { load, capacity, room })
            .collect();
        let total_load: u64 = cands.iter().map(|c| c.load).sum();
        let total_cap: u64 = cands.iter().map(|c| c.capacity).sum();
        let bound = |c: &Candidate| load_bound(c.capacity, total_load, total_cap, epsilon);
        let got = choose_backend(&cands, preferred, epsilon);
        match got {
            None => prop_assert!(cands.iter().all(|c| !c.room)),
            Some(i) => {
                prop_assert!(cands[i].room);
                if let Some(p) = preferred.filter(|&p| p < cands.len()) {
                    if cands[p].room && cands[p].load < bound(&cands[p]) {
                        prop_assert_eq!(i, p, "affinity not honoured within the bound");
                    }
                }
                if cands[i].load + 1 > bound(&cands[i]) {
                    prop_assert!(
                        cands.iter().all(|c| !c.room || c.load + 1 > bound(c)),
                        "placed above the bound while another backend had room under it"
                    );
                }
            }
        }
    }

    #[test]
    fn affinity_under_a_session_flood_stays_bounded(
        n in 2usize..6,
        epsilon in 0.05f64..1.0,
        ops in prop::collection::vec((0u64..4, any::<bool>()), 1..400),
    ) {
        // Few sessions, each always preferring where it went last; requests come and go.
        // With equal capacities and all backends open, nothing is ever placed above
        // ⌈(1+ε)·(L+1)/n⌉ — the least-loaded backend always fits under it.
        let cap = 1000u64;
        let mut load = vec![0u64; n];
        let mut sessions = SessionMap::new(16);
        let mut running: Vec<usize> = Vec::new();
        let names: Vec<std::sync::Arc<str>> = (0..n).map(|i| std::sync::Arc::from(format!("b{i}"))).collect();
        for (session, arrive) in ops {
            if !arrive {
                if let Some(i) = running.pop() {
                    load[i] -= 1;
                }
                continue;
            }
            let cands: Vec<Candidate> = load.iter().map(|&l| Candidate { load: l, capacity: cap, room: true }).collect();
            let preferred = sessions.get(session).and_then(|b| names.iter().position(|x| x == b));
            let total: u64 = load.iter().sum();
            let i = choose_backend(&cands, preferred, epsilon).unwrap();
            let bound = load_bound(cap, total, cap * n as u64, epsilon);
            prop_assert!(load[i] < bound, "backend {} at {} above {}", i, load[i] + 1, bound);
            load[i] += 1;
            running.push(i);
            sessions.record(session, names[i].clone());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Affinity through the admission path: sessions come back to their backend, requests end
// at random, and no request is placed above ⌈(1+ε)(L+1)/n⌉ on equal backends (no KV
// budget, no reports: fill is the request count) while another backend had room under it.

proptest! {
    #[test]
    fn admission_with_affinity_keeps_the_load_bound(
        epsilon in 0.0f64..1.0,
        ops in prop::collection::vec((0u64..6, 0u8..3), 1..300),
    ) {
        let mut cfg = AdmissionConfig::new();
        cfg.tenant_default = LimitSpec::UNLIMITED;
        let mut a: Admission<u32, u8> = Admission::new(cfg);
        let mut lane = LaneConfig::new(Watermarks::new(1000, 2000, 3000).unwrap());
        lane.kv_headroom = 0.0;
        lane.affinity = Some(AffinityConfig { epsilon, max_sessions: 64 });
        a.set_model(0, ModelSpec { limits: LimitSpec::UNLIMITED, lane });
        let names = ["b0", "b1", "b2"];
        let limits = BackendLimits { max_in_flight: 6, kv_tokens: None };
        a.set_backends(&0, names.iter().map(|n| (Arc::<str>::from(*n), limits)).collect());
        let mut running = Vec::new();
        for (session, op) in ops {
            if op == 0 && !running.is_empty() {
                let g = running.remove(session as usize % running.len());
                a.complete(g, Completion { outcome: Outcome::Success, actual_tokens: None, generated: None }, ts(1));
                continue;
            }
            let load: Vec<u64> = names
                .iter()
                .map(|n| a.lane(&0).unwrap().in_flight_of(n).unwrap() as u64)
                .collect();
            let total: u64 = load.iter().sum();
            let bound = load_bound(6, total, 18, epsilon);
            let req = AdmissionRequest {
                tenant: 1, model: 0, tier: Tier(0), prompt_tokens: 1, completion_tokens: 0,
                max_wait: None, session: Some(session),
                answered_at_end: false,
            };
            if let Admit::Dispatch(d) = a.admit(&req, 0, ts(1)) {
                let at = names.iter().position(|n| **n == **d.grant.backend().unwrap()).unwrap();
                if load[at] + 1 > bound {
                    prop_assert!(
                        load.iter().all(|&l| l >= 6 || l + 1 > bound),
                        "placed on {} at {} above {} while another had room", at, load[at] + 1, bound
                    );
                }
                running.push(d.grant);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Affinity on a flood without sessions: every request opens a conversation of its own (a
// key never seen before, as the gateway's hash of a single-turn request's opening is), so
// affinity has nothing to keep and decides exactly as load alone does: the same refusals,
// the same backends, the same queue order, whatever the arrivals, sizes and completions.

/// A lane of two backends (3 slots and 2,000 KV tokens each) with a small queue, four
/// tenants under one tier-wide fair share, and affinity on or off.
fn two_backends_with_a_queue(affinity: bool) -> Admission<u32, u8> {
    let mut cfg = AdmissionConfig::new();
    cfg.tenant_default = LimitSpec::UNLIMITED;
    let mut a: Admission<u32, u8> = Admission::new(cfg);
    let mut lane = LaneConfig::new(Watermarks::new(4, 8, 12).unwrap());
    lane.affinity = affinity.then_some(AffinityConfig {
        epsilon: 0.5,
        max_sessions: 64,
    });
    a.set_model(
        0,
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane,
        },
    );
    let limits = BackendLimits {
        max_in_flight: 3,
        kv_tokens: Some(2000),
    };
    a.set_backends(
        &0,
        ["b0", "b1"]
            .iter()
            .map(|n| (Arc::<str>::from(*n), limits))
            .collect(),
    );
    a
}

/// What a decision says, without its handles: dispatched (item, backend), queued (place)
/// or refused (reason).
fn decided(admit: Admit<u32, u8>, running: &mut Vec<Grant<u8>>) -> String {
    match admit {
        Admit::Dispatch(d) => {
            let said = format!("dispatch {} to {:?}", d.item, d.grant.backend());
            running.push(d.grant);
            said
        }
        Admit::Queued { position, .. } => format!("queued at {position}"),
        Admit::Refused(r) => format!("refused {} for {:?}", r.item, r.reason),
    }
}

/// Every queued request that may go now, as dispatched.
fn drained(
    a: &mut Admission<u32, u8>,
    now: Timestamp,
    running: &mut Vec<Grant<u8>>,
) -> Vec<String> {
    std::iter::from_fn(|| a.dequeue(&0, now))
        .map(|d| decided(Admit::Dispatch(d), running))
        .collect()
}

proptest! {
    #[test]
    fn affinity_decides_a_flood_without_sessions_as_load_alone(
        ops in prop::collection::vec((0u8..3, 0u8..4, 1u64..900, 0usize..16), 1..300),
    ) {
        let mut with = two_backends_with_a_queue(true);
        let mut without = two_backends_with_a_queue(false);
        let (mut running_with, mut running_without) = (Vec::new(), Vec::new());
        for (step, (op, tenant, tokens, pick)) in ops.into_iter().enumerate() {
            let now = ts(step as u64 * 10_000_000);
            if op == 0 && !running_with.is_empty() {
                prop_assert_eq!(running_with.len(), running_without.len());
                let i = pick % running_with.len();
                let done = Completion { outcome: Outcome::Success, actual_tokens: Some(tokens), generated: None };
                with.complete(running_with.remove(i), done, now);
                without.complete(running_without.remove(i), done, now);
            } else {
                let req = AdmissionRequest {
                    tenant: tenant + 1, model: 0, tier: Tier(0), prompt_tokens: tokens,
                    completion_tokens: 100, max_wait: Some(Duration::from_secs(60)),
                    session: Some(step as u64), answered_at_end: false,
                };
                let a = decided(with.admit(&req, step as u32, now), &mut running_with);
                let mut plain = req.clone();
                plain.session = None;
                let b = decided(without.admit(&plain, step as u32, now), &mut running_without);
                prop_assert_eq!(a, b, "step {}", step);
            }
            let a = drained(&mut with, now, &mut running_with);
            let b = drained(&mut without, now, &mut running_without);
            prop_assert_eq!(a, b, "queue after step {}", step);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Fleet budgets: the max-min split, and replicas leasing slices of one backend's budget in
// any order never hold, nor admit, more than the budget between them.

proptest! {
    #[test]
    fn fair_split_is_within_wants_and_budget_and_max_min(
        wants in proptest::collection::vec(0u64..100, 0..6),
        budget in 0u64..300,
    ) {
        let parts = fair_split(&wants, budget);
        let total: u64 = parts.iter().sum();
        prop_assert_eq!(total, wants.iter().sum::<u64>().min(budget));
        for (i, (&p, &w)) in parts.iter().zip(&wants).enumerate() {
            prop_assert!(p <= w);
            if p < w {
                for &q in &parts {
                    prop_assert!(p + 1 >= q, "entry {} got {} of {}, another {}", i, p, w, q);
                }
            }
        }
    }

    #[test]
    fn tiered_split_serves_classes_in_order_within_wants_and_budget(
        wants in proptest::collection::vec(proptest::collection::vec(0u64..60, 0..4), 0..5),
        budget in 0u64..300,
    ) {
        let parts = tiered_split(&wants, budget);
        let sum = |w: &[u64], through: usize| w.iter().take(through + 1).sum::<u64>();
        let all: u64 = wants.iter().map(|w| w.iter().sum::<u64>()).sum();
        prop_assert_eq!(parts.iter().sum::<u64>(), all.min(budget));
        for (i, w) in wants.iter().enumerate() {
            prop_assert!(parts[i] <= w.iter().sum::<u64>());
            // The highest class in which entry i is not met in full: nobody gets anything
            // for a lower class (no one's part passes its wants through that class).
            let Some(c) = (0..w.len()).find(|&c| parts[i] < sum(w, c)) else { continue };
            for (j, v) in wants.iter().enumerate() {
                prop_assert!(
                    parts[j] <= sum(v, c),
                    "entry {} short in class {} ({} of {:?}) while entry {} got {} of {:?}",
                    i, c, parts[i], w, j, parts[j], v
                );
            }
        }
    }

    #[test]
    fn replicas_leasing_slices_never_exceed_the_budget(
        budget in 1u64..40,
        ops in proptest::collection::vec((0usize..3, 0u8..5, 0u64..50), 1..300),
    ) {
        // The shared state's rule (the Redis script's): a grant is min(tiered share, budget
        // − the others' holdings); the holding recorded is max(grant, what the replica
        // reported it may run). A renewal is two steps: the script runs on the demand the
        // replica sent, and the grant reaches the replica later; meanwhile the replica keeps
        // admitting against its previous grant, so it reports max(in flight, that grant).
        // Two tiers.
        #[derive(Default, Clone)]
        struct R {
            hold: u64,
            want: Vec<u64>,
            allowed: u64,
            in_flight: [u64; 2],
            queued: [u64; 2],
            answer: Option<u64>,
        }
        let mut rs = vec![R::default(); 3];
        let b = Budget { slots: budget, kv_tokens: 0 };
        for (r, op, n) in ops {
            match op {
                0 => {
                    // a renewal with the replica's demand reaches the shared state
                    let demand: Vec<SliceDemand> = (0..2)
                        .map(|t| SliceDemand { in_flight: rs[r].in_flight[t], queued: rs[r].queued[t], ..SliceDemand::default() })
                        .collect();
                    rs[r].want = slice_want(b, &demand).iter().map(|w| w.slots).collect();
                    let wants: Vec<Vec<u64>> = rs.iter().map(|x| x.want.clone()).collect();
                    let share = tiered_split(&wants, budget)[r];
                    let others: u64 = rs.iter().enumerate().filter(|(j, _)| *j != r).map(|(_, x)| x.hold).sum();
                    let grant = share.min(budget.saturating_sub(others));
                    let may_run = rs[r].in_flight.iter().sum::<u64>().max(rs[r].allowed);
                    rs[r].hold = grant.max(may_run);
                    rs[r].answer = Some(grant);
                }
                4 => {
                    // the grant reaches the replica
                    if let Some(g) = rs[r].answer.take() { rs[r].allowed = g }
                }
                1 => {
                    // requests of one tier arrive: admitted within the allowance, the rest queue
                    let t = (n % 2) as usize;
                    for _ in 0..n % 8 {
                        if rs[r].in_flight.iter().sum::<u64>() < rs[r].allowed { rs[r].in_flight[t] += 1 } else { rs[r].queued[t] += 1 }
                    }
                }
                2 => {
                    let t = (n % 2) as usize;
                    rs[r].in_flight[t] = rs[r].in_flight[t].saturating_sub(n % 4);
                }
                _ => {
                    // death: its requests go with it, its lease expires
                    rs[r] = R::default();
                }
            }
            let in_flight: u64 = rs.iter().map(|x| x.in_flight.iter().sum::<u64>()).sum();
            let held: u64 = rs.iter().map(|x| x.hold).sum();
            prop_assert!(in_flight <= budget, "{} in flight over {}", in_flight, budget);
            prop_assert!(held <= budget, "{} held over {}", held, budget);
        }
    }
}
