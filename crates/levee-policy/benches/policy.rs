//! levee-policy benchmarks: our GCRA beside `governor`'s on the same quota, and the full
//! admission decision as the gateway runs it (limits + watermark + fair share + KV budget +
//! dispatch or enqueue + completion + dequeue) on one thread, on two threads for two models
//! (each lane behind its own lock, the shared limits between them), and on two threads for
//! one model (both contending for its lane's lock).
//!
//! Run: `cargo bench -p levee-policy --bench policy` (about a minute).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use governor::clock::{Clock as _, FakeRelativeClock, Reference as _};
use governor::{Quota as GQuota, RateLimiter};
use levee_policy::*;
use parking_lot::Mutex;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

// The benchmark allocates as the `levee` binary does.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const RATE: u32 = 1_000; // per second
const BURST: u32 = 50;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

fn gcra(c: &mut Criterion) {
    let mut g = c.benchmark_group("gcra_check");
    g.measurement_time(Duration::from_secs(3)).sample_size(40);
    // Injected time: both limiters see time advance by 1 ms per call, exactly the rate, so
    // every call is admitted (the common path).
    g.bench_function("levee/injected_time", |b| {
        let mut lim = Gcra::new(Quota::per_second(RATE as u64).with_burst(BURST as u64));
        let mut now = 1_000_000u64;
        b.iter(|| {
            now += 1_000_000;
            black_box(lim.check(black_box(Timestamp::from_nanos(now))))
        })
    });
    g.bench_function("governor/fake_clock", |b| {
        let clock = FakeRelativeClock::default();
        let lim = RateLimiter::direct_with_clock(
            GQuota::per_second(nz(RATE)).allow_burst(nz(BURST)),
            clock.clone(),
        );
        b.iter(|| {
            clock.advance(Duration::from_millis(1));
            black_box(lim.check())
        })
    });
    // Refusal path: time frozen after the burst is spent.
    g.bench_function("levee/refused", |b| {
        let mut lim = Gcra::new(Quota::per_second(RATE as u64).with_burst(BURST as u64));
        let now = Timestamp::from_nanos(1);
        while lim.check(now).is_ok() {}
        b.iter(|| black_box(lim.check(black_box(now))))
    });
    g.bench_function("governor/refused", |b| {
        let clock = FakeRelativeClock::default();
        let lim = RateLimiter::direct_with_clock(
            GQuota::per_second(nz(RATE)).allow_burst(nz(BURST)),
            clock.clone(),
        );
        while lim.check().is_ok() {}
        b.iter(|| black_box(lim.check()))
    });
    // Real clocks, each crate's default: ours reads SystemClock, governor its QuantaClock.
    g.bench_function("levee/system_clock", |b| {
        let clock = SystemClock::new();
        let mut lim = Gcra::new(Quota::per_second(1_000_000_000).with_burst(1_000_000));
        b.iter(|| black_box(lim.check(clock.now())))
    });
    // Ours with governor's own clock (quanta, TSC-based): the same time source for both.
    g.bench_function("levee/quanta_clock", |b| {
        let clock = governor::clock::QuantaClock::default();
        let origin = clock.now();
        let mut lim = Gcra::new(Quota::per_second(1_000_000_000).with_burst(1_000_000));
        b.iter(|| {
            let now = Timestamp::from_nanos(clock.now().duration_since(origin).as_u64());
            black_box(lim.check(now))
        })
    });
    g.bench_function("governor/default_clock", |b| {
        let lim =
            RateLimiter::direct(GQuota::per_second(nz(1_000_000_000)).allow_burst(nz(1_000_000)));
        b.iter(|| black_box(lim.check()))
    });
    // Keyed, 1024 keys round-robin.
    g.bench_function("levee/keyed_1024", |b| {
        let mut lim: KeyedGcra<u64> = KeyedGcra::new(
            Some(Quota::per_second(RATE as u64).with_burst(BURST as u64)),
            4096,
        );
        let mut now = 1_000_000u64;
        let mut k = 0u64;
        b.iter(|| {
            now += 1_000;
            k = (k + 1) & 1023;
            black_box(lim.check(&k, Timestamp::from_nanos(now)))
        })
    });
    g.bench_function("governor/keyed_1024", |b| {
        let clock = FakeRelativeClock::default();
        let lim = RateLimiter::hashmap_with_clock(
            GQuota::per_second(nz(RATE)).allow_burst(nz(BURST)),
            clock.clone(),
        );
        let mut k = 0u64;
        b.iter(|| {
            clock.advance(Duration::from_micros(1));
            k = (k + 1) & 1023;
            black_box(lim.check_key(&k))
        })
    });
    g.finish();

    // What a clock read alone costs, to separate it from the check.
    let mut g = c.benchmark_group("clock_read");
    g.bench_function("levee_system_clock", |b| {
        let clock = SystemClock::new();
        b.iter(|| black_box(clock.now()))
    });
    g.bench_function("levee_std_clock", |b| {
        let clock = StdClock::new();
        b.iter(|| black_box(clock.now()))
    });
    g.bench_function("std_instant_now", |b| b.iter(|| black_box(Instant::now())));
    g.bench_function("governor_quanta_clock", |b| {
        let clock = governor::clock::QuantaClock::default();
        b.iter(|| black_box(clock.now()))
    });
    g.finish();
}

/// The admission setup the benchmark drives — the composition the gateway runs, with every
/// scope limited (global, model, tenant: requests/min, tokens/min, concurrency), the heavy
/// rule on, 64 tenants in 3 tiers, and a model lane of 2 backends with request caps and KV
/// budgets. 160 requests are kept outstanding against 128 backend slots, so about 32 wait in
/// the fair queue: a decision admits one request (dispatched, or queued behind others),
/// completes the oldest in flight, and dispatches what that frees (fair share, KV fit).
///
/// As in the gateway, the lane is a [`LaneAdmission`] behind its own lock and the limits
/// every lane shares are one [`SharedLimits`]; each tenant's limits are looked up once and
/// kept. Two `Bench`es built on one `SharedLimits` are two models of one gateway.
struct Bench<K> {
    shared: Arc<SharedLimits<K>>,
    lane: Mutex<LaneAdmission<u64, K>>,
    reqs: Vec<(AdmissionRequest<K>, Arc<TenantLimits>)>,
    in_flight: std::collections::VecDeque<Grant<K>>,
    now: u64,
    i: usize,
}

type KeyBench = Bench<Key>;

const OUTSTANDING: usize = 160;

fn big() -> LimitSpec {
    LimitSpec {
        requests_per_minute: Some(10_000_000_000),
        request_burst: Some(1_000_000),
        tokens_per_minute: Some(1_000_000_000_000),
        token_burst: Some(1_000_000_000),
        max_concurrent: Some(100_000),
    }
}

fn bench_config() -> AdmissionConfig {
    let mut cfg = AdmissionConfig::new();
    cfg.global = big();
    cfg.tenant_default = big();
    cfg.heavy = Some(HeavyRule {
        prompt_tokens_over: 8_000,
        completion_tokens_over: 4_096,
        per_tenant: big(),
    });
    cfg
}

impl<K: std::hash::Hash + Eq + Ord + Clone> Bench<K> {
    /// Model `model` of a gateway whose shared limits are `shared`, with 64 tenants named
    /// `{tenants}-NN` (two benches with the same prefix share their tenants).
    fn new(key: fn(&str) -> K, shared: Arc<SharedLimits<K>>, model: &str, tenants: &str) -> Self {
        let mut lane_cfg = LaneConfig::new(Watermarks {
            safe: 1_000,
            soft: 10_000,
            hard: 20_000,
        });
        lane_cfg.queue_max_tokens = 100_000_000;
        let spec = ModelSpec {
            limits: big(),
            lane: lane_cfg,
        };
        let mut lane = LaneAdmission::new(spec, &bench_config());
        let backends = (0..2)
            .map(|i| {
                (
                    Arc::from(format!("{model}@http://10.0.0.{i}:8000").as_str()),
                    BackendLimits {
                        max_in_flight: 64,
                        kv_tokens: Some(400_000),
                    },
                )
            })
            .collect();
        lane.lane_mut().set_backends(backends);
        let model = key(model);
        let mut reqs = Vec::new();
        for t in 0..64 {
            let tenant = key(&format!("{tenants}-{t:02}"));
            let limits = shared.set_tenant(
                tenant.clone(),
                TenantSpec {
                    limits: big(),
                    weight: if t % 4 == 0 { 2 } else { 1 },
                },
            );
            let req = AdmissionRequest {
                tenant,
                model: model.clone(),
                tier: Tier((t % 3) as u8),
                prompt_tokens: 200 + (t as u64 * 37) % 800,
                completion_tokens: 256,
                max_wait: None,
                session: None,
                answered_at_end: false,
            };
            reqs.push((req, limits));
        }
        Bench {
            shared,
            lane: Mutex::new(lane),
            reqs,
            in_flight: std::collections::VecDeque::new(),
            now: 1_000_000,
            i: 0,
        }
    }

    fn alone(key: fn(&str) -> K) -> Self {
        let shared = Arc::new(SharedLimits::from_config(&bench_config()));
        Bench::new(key, shared, "llama-3-8b", "tenant")
    }

    fn done(g: &Grant<K>) -> Completion {
        Completion {
            outcome: Outcome::Success,
            actual_tokens: Some(g.tokens() / 2),
            generated: None,
        }
    }

    /// One full decision: admit (all limits, watermark, fair share, KV fit, dispatch or
    /// enqueue), complete the oldest request in flight, dispatch what that frees — with the
    /// lane's lock held, as the gateway holds it. Never inlined: `bench/decision-instructions.sh`
    /// finds the decisions in a profile by this function's name (a call costs a few
    /// instructions of the ~10,000 a decision takes).
    #[inline(never)]
    fn cycle(&mut self) {
        self.now += 1_000;
        self.i = (self.i + 1) % self.reqs.len();
        let now = Timestamp::from_nanos(self.now);
        let (req, tenant) = &self.reqs[self.i];
        let mut lane = self.lane.lock();
        match lane.admit_as(&self.shared, tenant, req, self.i as u64, now) {
            Admit::Dispatch(d) => self.in_flight.push_back(d.grant),
            other => {
                black_box(&other);
            }
        }
        if self.in_flight.len() + lane.lane().queued() > OUTSTANDING {
            if let Some(g) = self.in_flight.pop_front() {
                let done = Self::done(&g);
                lane.complete(&self.shared, g, done, now);
            }
        }
        while let Some(d) = lane.dequeue(&self.shared, now) {
            self.in_flight.push_back(d.grant);
        }
    }
}

/// Threads that keep their work for the whole benchmark, as the one-thread case keeps its
/// bench: every sample goes on with the same lanes (their queues, rate estimators and
/// simulated time) instead of fresh ones built for it, so one and two threads are measured
/// in the same state (one thread run on fresh lanes per sample took 4-10% longer than the
/// one-thread bench, measured by hand on 2026-12-06). The lanes are built on the main thread
/// and run on others, as the gateway builds them at configuration load and runs them on its
/// workers.
struct Team {
    go: Vec<mpsc::Sender<u64>>,
    done: mpsc::Receiver<()>,
}

impl Team {
    /// One thread per job; the threads end when the team is dropped.
    fn new(jobs: Vec<Box<dyn FnMut() + Send>>) -> Team {
        let (done_tx, done) = mpsc::channel();
        let go = jobs
            .into_iter()
            .map(|mut job| {
                let (tx, rx) = mpsc::channel::<u64>();
                let done_tx = done_tx.clone();
                std::thread::spawn(move || {
                    for iters in rx {
                        for _ in 0..iters {
                            job();
                        }
                        if done_tx.send(()).is_err() {
                            return;
                        }
                    }
                });
                tx
            })
            .collect();
        Team { go, done }
    }

    /// Runs `iters` of every job at once, each on its thread; the wall time until the last
    /// is done.
    fn run(&self, iters: u64) -> Duration {
        let start = Instant::now();
        for tx in &self.go {
            if tx.send(iters).is_err() {
                panic!("a bench thread is gone (it panicked: see above)");
            }
        }
        for _ in &self.go {
            if self.done.recv().is_err() {
                panic!("a bench thread is gone (it panicked: see above)");
            }
        }
        start.elapsed()
    }

    /// Two threads taking turns at one `T` behind one lock, each running `step` on it.
    fn sharing<T: Send + 'static>(shared: T, step: fn(&mut T)) -> Team {
        let shared = Arc::new(Mutex::new(shared));
        Team::new(
            (0..2)
                .map(|_| {
                    let shared = Arc::clone(&shared);
                    Box::new(move || step(&mut shared.lock())) as Box<dyn FnMut() + Send>
                })
                .collect(),
        )
    }

    /// A thread per bench, each cycling its own.
    fn of(benches: Vec<KeyBench>) -> Team {
        Team::new(
            benches
                .into_iter()
                .map(|mut b| Box::new(move || b.cycle()) as Box<dyn FnMut() + Send>)
                .collect(),
        )
    }
}

fn admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("admission");
    // The gateway's keys: `Key` tenant and model names (hash computed once, at config load).
    g.bench_function("full_decision/1_thread", |b| {
        let mut s = KeyBench::alone(Key::new);
        b.iter(|| s.cycle())
    });
    // The same with plain `Arc<str>` names (a string hash and compare per lookup).
    g.bench_function("full_decision/1_thread_arc_str_keys", |b| {
        let mut s: Bench<Arc<str>> = Bench::alone(|n| Arc::from(n));
        b.iter(|| s.cycle())
    });
    // The one-thread case in the harness of the two-thread ones (a thread of its own, its
    // lane built on the main thread, the decisions behind a boxed closure): what the
    // harness alone adds, so that the two-thread figures read against it show contention.
    g.bench_function("full_decision/1_thread_in_team", |b| {
        let team = Team::of(vec![KeyBench::alone(Key::new)]);
        b.iter_custom(|iters| team.run(iters))
    });
    // Two threads deciding for two models of one gateway: each lane under its own lock, the
    // global scope's rates and concurrency (limited here) shared. Reported time per
    // iteration is wall time / iters: the latency of one decision as each thread sees it.
    g.bench_function("full_decision/2_threads_2_models", |b| {
        let shared = Arc::new(SharedLimits::from_config(&bench_config()));
        let team = Team::of(vec![
            KeyBench::new(Key::new, shared.clone(), "llama-3-8b", "a"),
            KeyBench::new(Key::new, shared, "mistral-7b", "b"),
        ]);
        b.iter_custom(|iters| team.run(iters))
    });
    // The same with one set of tenants sending to both models: their limits are shared too.
    g.bench_function("full_decision/2_threads_2_models_same_tenants", |b| {
        let shared = Arc::new(SharedLimits::from_config(&bench_config()));
        let team = Team::of(vec![
            KeyBench::new(Key::new, shared.clone(), "llama-3-8b", "t"),
            KeyBench::new(Key::new, shared, "mistral-7b", "t"),
        ]);
        b.iter_custom(|iters| team.run(iters))
    });
    // Two threads deciding for one model: both contend for its lane's lock, as every
    // decision did when the gateway had one lock for all models.
    g.bench_function("full_decision/2_threads_1_model", |b| {
        let team = Team::sharing(KeyBench::alone(Key::new), KeyBench::cycle);
        b.iter_custom(|iters| team.run(iters))
    });
    // The floor under contention: the same lock taken and released with no work inside.
    g.bench_function("mutex_only/2_threads", |b| {
        let team = Team::sharing(0u64, |n| *n += 1);
        b.iter_custom(|iters| team.run(iters))
    });
    // Parts of the decision, for orientation.
    g.bench_function("queue_push_pop", |b| {
        let mut q: FairQueue<u64, Arc<str>> = FairQueue::new(QueueLimits {
            tiers: 3,
            max_len: 10_000,
            max_tokens: u64::MAX,
        });
        let tenants: Vec<Arc<str>> = (0..64)
            .map(|t| Arc::from(format!("t{t}").as_str()))
            .collect();
        for (i, t) in tenants.iter().enumerate() {
            let _ = q.push(
                Tier((i % 3) as u8),
                t.clone(),
                100,
                Timestamp::ZERO,
                Timestamp::MAX,
                0,
            );
        }
        let mut i = 0usize;
        b.iter_batched_ref(
            || (),
            |_| {
                i = (i + 1) % 64;
                let _ = q.push(
                    Tier((i % 3) as u8),
                    tenants[i].clone(),
                    100,
                    Timestamp::ZERO,
                    Timestamp::from_nanos(1_000_000_000 + i as u64),
                    i as u64,
                );
                black_box(q.pop())
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = gcra, admission
}
criterion_main!(benches);
