//! The scheduler task: one per engine, it drives the [`GpuModel`] in simulated time, takes
//! requests and cancellations from the HTTP handlers, and hands each request its tokens.

use crate::config::EngineConfig;
use crate::gpu::{Event, FailReason, GpuModel, GpuStats, Health, SeqId, SubmitError};
use crate::metrics::{FinishLabel, Metrics};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Back-to-back steps start where the previous one ended in simulated time, so timer
/// lateness does not add up; after a lag longer than this (real time) the schedule resets
/// to now instead of bursting to catch up.
const MAX_CATCH_UP: Duration = Duration::from_millis(50);

/// Simulated time: wall time since the engine started, multiplied by the time scale.
/// Built on tokio's clock, so paused-time tests drive it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SimClock {
    start: Instant,
    scale: f64,
}

impl SimClock {
    pub fn new(scale: f64) -> Self {
        Self {
            start: Instant::now(),
            scale,
        }
    }

    /// Simulated time now.
    pub fn now(&self) -> Duration {
        self.start.elapsed().mul_f64(self.scale)
    }

    /// The wall-clock instant of simulated time `sim`.
    pub fn real_at(&self, sim: Duration) -> Instant {
        self.start + sim.div_f64(self.scale)
    }

    /// Wall-clock length of a simulated duration.
    pub fn real(&self, sim: Duration) -> Duration {
        sim.div_f64(self.scale)
    }
}

/// Faults injected at run time through the admin API or [`crate::EngineHandle`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Simulated milliseconds added before each new request reaches the scheduler
    /// (so TTFT and end-to-end latency grow by this much).
    pub added_latency_ms: f64,
    /// Fraction (0..=1) of new requests answered at once with a 500 `injected_error`.
    pub error_rate: f64,
    /// A hung GPU: no step runs, so running streams stall and new requests are accepted but
    /// never answered, until cleared. `/health` still answers 200 (the nasty case).
    pub hang: bool,
}

/// A partial update of [`Faults`]: fields left out keep their value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsUpdate {
    /// New `added_latency_ms`.
    pub added_latency_ms: Option<f64>,
    /// New `error_rate`.
    pub error_rate: Option<f64>,
    /// New `hang`.
    pub hang: Option<bool>,
}

/// Whether the engine serves, is down after a crash, or is hung.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    /// Serving.
    Healthy,
    /// Down after a crash; `/health` and every `/v1` route answer 503.
    Crashed,
    /// Hung by a fault: accepts requests, makes no progress.
    Hung,
    /// Shut down.
    Stopped,
}

/// A snapshot of what the engine is doing, published after every step.
/// Times are simulated seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Healthy, crashed, hung or stopped.
    pub state: EngineState,
    /// Simulated seconds left until a crashed engine is back.
    pub restart_in_secs: Option<f64>,
    /// Simulated time (seconds since start) at which a crashed engine is back.
    pub restart_at_secs: Option<f64>,
    /// Simulated time of this snapshot (seconds since the engine started).
    pub sim_time_secs: f64,
    /// Sequences in the running batch.
    pub running: usize,
    /// Requests waiting in the engine's queue (including preempted ones).
    pub waiting: usize,
    /// KV blocks in use (of 16 tokens each).
    pub kv_used_blocks: u64,
    /// KV blocks in the cache.
    pub kv_blocks: u64,
    /// KV tokens in use, in whole blocks (`kv_used_blocks × 16`).
    pub kv_used_tokens: u64,
    /// KV capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// `kv_used_blocks / kv_blocks`, 0..=1.
    pub kv_usage: f64,
    /// Crashes so far.
    pub crashes: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Requests completed (all tokens produced).
    pub completed: u64,
    /// Requests failed inside the engine (crash or shutdown).
    pub failed: u64,
    /// Requests cancelled by their client.
    pub cancelled: u64,
    /// Steps run so far.
    pub steps: u64,
    /// Sum of the configured (simulated) durations of those steps, in seconds.
    pub busy_secs: f64,
    /// KV blocks kept by the prefix cache and held by no sequence (free for admission).
    pub kv_cached_blocks: u64,
    /// Prompt tokens looked up in the prefix cache at admissions.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (not computed).
    pub prefix_cache_hits: u64,
    /// Steps whose wall-clock end came later than planned by more than 1 ms of real time
    /// (the host could not keep the simulated pace).
    pub late_steps: u64,
    /// Sum over steps of how late each ended, in simulated seconds.
    pub lag_secs: f64,
}

impl EngineStats {
    /// The snapshot with its clock fields brought to simulated time `now`: the scheduler
    /// publishes after each step and command, so an idle or crashed engine's last snapshot
    /// can be old.
    pub(crate) fn at(mut self, now: Duration) -> Self {
        let now_secs = now.as_secs_f64();
        self.sim_time_secs = self.sim_time_secs.max(now_secs);
        self.restart_in_secs = self.restart_at_secs.map(|at| (at - now_secs).max(0.0));
        self
    }

    fn new(gpu: &GpuStats, health: Health, hung: bool, now: Duration, lag: &LagStats) -> Self {
        let now_secs = now.as_secs_f64();
        let (state, restart_at_secs) = match health {
            Health::Crashed { until_secs } => (EngineState::Crashed, Some(until_secs)),
            Health::Healthy if hung => (EngineState::Hung, None),
            Health::Healthy => (EngineState::Healthy, None),
        };
        Self {
            state,
            restart_in_secs: restart_at_secs.map(|at| (at - now_secs).max(0.0)),
            restart_at_secs,
            sim_time_secs: now_secs,
            running: gpu.running,
            waiting: gpu.waiting,
            kv_used_blocks: gpu.kv_used_blocks,
            kv_blocks: gpu.kv_blocks,
            kv_used_tokens: gpu.kv_used_tokens,
            kv_capacity_tokens: gpu.kv_capacity_tokens,
            kv_usage: gpu.kv_usage(),
            crashes: gpu.crashes,
            preemptions: gpu.preemptions,
            completed: gpu.completed,
            failed: gpu.failed,
            cancelled: gpu.cancelled,
            steps: gpu.steps,
            busy_secs: gpu.busy_secs,
            kv_cached_blocks: gpu.kv_cached_blocks,
            prefix_cache_queries: gpu.prefix_cache_queries,
            prefix_cache_hits: gpu.prefix_cache_hits,
            late_steps: lag.late_steps,
            lag_secs: lag.lag.as_secs_f64(),
        }
    }
}

#[derive(Debug, Default)]
struct LagStats {
    late_steps: u64,
    lag: Duration,
}

/// What a request's handler hears from the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqEvent {
    /// First admitted: `cached` prompt tokens were found in the prefix cache.
    Admitted { cached: u32 },
    /// Token number `index` is ready.
    Token(u32),
    /// All tokens were produced.
    Finished,
    /// The request failed.
    Failed(FailReason),
    /// The model refused the request.
    Rejected(SubmitError),
}

/// A request as the scheduler receives it.
#[derive(Debug)]
pub(crate) struct Submission {
    pub id: SeqId,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Block hashes of prompt + completion (the prefix cache's keys).
    pub hashes: Vec<u64>,
    /// `"length"` or `"stop"`, for the success counter.
    pub finish_reason: &'static str,
    /// Simulated arrival time (TTFT starts here).
    pub arrived: Duration,
    pub events: mpsc::UnboundedSender<SeqEvent>,
}

/// Orders to the scheduler.
#[derive(Debug)]
pub(crate) enum Command {
    Submit(Submission),
    Cancel(SeqId),
    Crash,
    Hang(bool),
    Shutdown,
}

/// State shared by the HTTP handlers, the scheduler and the [`crate::EngineHandle`].
pub(crate) struct Shared {
    pub config: EngineConfig,
    pub clock: SimClock,
    pub commands: mpsc::UnboundedSender<Command>,
    pub stats: watch::Receiver<EngineStats>,
    pub faults: parking_lot::Mutex<Faults>,
    pub metrics: Metrics,
    pub next_id: AtomicU64,
    /// Crashes ordered from outside (`POST /admin/crash`, [`crate::EngineHandle::crash_now`]),
    /// as opposed to those the KV cache caused: a drill reports the two apart.
    pub injected_crashes: AtomicU64,
    /// Refusals while down, per down period (see [`Shared::refuse_while_down`]).
    pub down_log: parking_lot::Mutex<DownLog>,
}

/// The engine's own record of what reached it while it was down: the first refusal of each
/// down period tells a router the engine failed; whatever arrives after that answer is
/// traffic the router sent although it had been told.
#[derive(Debug, Default)]
pub struct DownLog {
    /// The crash count of the down period being logged.
    epoch: u64,
    /// Whether this period's first refusal has been answered.
    answered: bool,
    /// Refusals that arrived after a first refusal of their down period had been answered.
    pub after_first: u64,
}

impl Shared {
    /// Answers a request that reached the engine while it was down (`crashes` is the crash
    /// count, which names the down period): counted as `unavailable`, and apart when an
    /// earlier refusal of the same period had already been answered.
    pub fn refuse_while_down(&self, crashes: u64) {
        self.metrics.fail("unavailable");
        let mut log = self.down_log.lock();
        if log.epoch != crashes {
            log.epoch = crashes;
            log.answered = false;
        }
        if log.answered {
            log.after_first += 1;
        }
        log.answered = true;
    }

    /// The latest published stats, with clock fields brought to now.
    pub fn stats_now(&self) -> EngineStats {
        let stats = self.stats.borrow().clone();
        stats.at(self.clock.now())
    }

    /// A fresh request id.
    pub fn next_id(&self) -> SeqId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Applies a fault update; tells the scheduler when `hang` changes.
    pub fn update_faults(&self, update: &FaultsUpdate) -> anyhow::Result<Faults> {
        if let Some(rate) = update.error_rate {
            anyhow::ensure!(
                (0.0..=1.0).contains(&rate),
                "error_rate must be between 0 and 1, got {rate}"
            );
        }
        if let Some(ms) = update.added_latency_ms {
            anyhow::ensure!(
                ms.is_finite() && ms >= 0.0,
                "added_latency_ms must be a finite number >= 0, got {ms}"
            );
        }
        let mut faults = self.faults.lock();
        if let Some(rate) = update.error_rate {
            faults.error_rate = rate;
        }
        if let Some(ms) = update.added_latency_ms {
            faults.added_latency_ms = ms;
        }
        if let Some(hang) = update.hang {
            if hang != faults.hang {
                faults.hang = hang;
                // A closed channel means the engine stopped: nothing left to hang.
                let _ = self.commands.send(Command::Hang(hang));
            }
        }
        Ok(faults.clone())
    }
}

/// Creates the channels and the shared state; the returned future is the scheduler task.
pub(crate) fn start(
    config: EngineConfig,
) -> (Arc<Shared>, impl std::future::Future<Output = ()> + Send) {
    let (commands, rx) = mpsc::unbounded_channel();
    let model = GpuModel::new(config.gpu.clone());
    let clock = SimClock::new(config.time_scale);
    let initial = EngineStats::new(
        &model.stats(),
        model.health(),
        false,
        Duration::ZERO,
        &LagStats::default(),
    );
    let (stats_tx, stats_rx) = watch::channel(initial);
    let shared = Arc::new(Shared {
        metrics: Metrics::new(
            &config.model,
            crate::config::KV_BLOCK_SIZE,
            config.gpu.kv_blocks(),
        ),
        config,
        clock,
        commands,
        stats: stats_rx,
        faults: parking_lot::Mutex::new(Faults::default()),
        next_id: AtomicU64::new(1),
        injected_crashes: AtomicU64::new(0),
        down_log: parking_lot::Mutex::new(DownLog::default()),
    });
    let scheduler = Scheduler {
        model,
        shared: shared.clone(),
        rx,
        stats_tx,
        senders: HashMap::new(),
        events: Vec::new(),
        hung: false,
        stopped: false,
        lag: LagStats::default(),
    };
    (shared, scheduler.run())
}

/// Copies the engine's state into the `/metrics` gauges every
/// [`EngineConfig::metrics_refresh_secs`] (simulated), so that between refreshes they show
/// the engine as it was at the last one. Ends when the engine stops. Not used when the
/// interval is 0 (the scheduler then sets the gauges after every step).
pub(crate) async fn refresh_gauges(shared: Arc<Shared>) {
    let secs = shared.config.metrics_refresh_secs;
    if secs <= 0.0 {
        return;
    }
    let period = shared.clock.real(Duration::from_secs_f64(secs));
    let mut tick = tokio::time::interval_at(Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let stats = shared.stats.borrow().clone();
        if stats.state == EngineState::Stopped {
            return;
        }
        shared
            .metrics
            .set_gauges(stats.running, stats.waiting, stats.kv_usage);
    }
}

struct Client {
    events: mpsc::UnboundedSender<SeqEvent>,
    finish_reason: &'static str,
}

struct Scheduler {
    model: GpuModel,
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Command>,
    stats_tx: watch::Sender<EngineStats>,
    senders: HashMap<SeqId, Client>,
    events: Vec<Event>,
    hung: bool,
    stopped: bool,
    lag: LagStats,
}

impl Scheduler {
    async fn run(mut self) {
        let clock = self.shared.clock;
        // Simulated end of the previous step when steps run back to back.
        let mut last_end: Option<Duration> = None;
        loop {
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            if self.stopped {
                return self.stop();
            }
            self.flush();
            // A crashed engine is down, not hung: it restarts on time either way.
            if self.hung && self.model.health() == Health::Healthy {
                last_end = None;
                match self.rx.recv().await {
                    Some(cmd) => self.handle(cmd),
                    None => return self.stop(),
                }
                continue;
            }
            let now = clock.now();
            let start = match last_end {
                Some(end) if clock.real(now.saturating_sub(end)) <= MAX_CATCH_UP => end,
                _ => now,
            };
            let Some(duration) = self.model.begin_step(start, &mut self.events) else {
                last_end = None;
                self.flush();
                let restart = self.model.restart_at().map(|at| clock.real_at(at));
                let cmd = match restart {
                    Some(at) => tokio::select! {
                        _ = tokio::time::sleep_until(at) => continue,
                        cmd = self.rx.recv() => cmd,
                    },
                    None => self.rx.recv().await,
                };
                match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => return self.stop(),
                }
                continue;
            };
            self.flush();
            let end = start + duration;
            if duration.is_zero() {
                // Nothing to wait for, but let the handlers run between steps.
                tokio::task::yield_now().await;
            } else {
                let sleep = tokio::time::sleep_until(clock.real_at(end));
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        biased;
                        _ = &mut sleep => break,
                        cmd = self.rx.recv() => match cmd {
                            Some(cmd) => {
                                self.handle(cmd);
                                // Cancellations free KV mid-step: publish at once.
                                self.flush();
                                if self.stopped || self.model.health() != Health::Healthy {
                                    break;
                                }
                            }
                            None => return self.stop(),
                        },
                    }
                }
            }
            // `end_step` does nothing if the step was cut short by a crash.
            self.model.end_step(end, &mut self.events);
            let late = clock.now().saturating_sub(end);
            if clock.real(late) > Duration::from_millis(1) {
                self.lag.late_steps += 1;
            }
            self.lag.lag += late;
            self.flush();
            last_end = (self.model.health() == Health::Healthy).then_some(end);
        }
    }

    fn handle(&mut self, cmd: Command) {
        let now = self.shared.clock.now();
        match cmd {
            Command::Submit(sub) => {
                match self.model.submit(
                    sub.id,
                    sub.prompt_tokens,
                    sub.completion_tokens,
                    sub.arrived,
                    sub.hashes,
                ) {
                    Ok(()) => {
                        self.senders.insert(
                            sub.id,
                            Client {
                                events: sub.events,
                                finish_reason: sub.finish_reason,
                            },
                        );
                    }
                    Err(e) => {
                        if e == SubmitError::Unavailable {
                            self.shared.refuse_while_down(self.model.stats().crashes);
                        }
                        let _ = sub.events.send(SeqEvent::Rejected(e));
                    }
                }
            }
            Command::Cancel(id) => {
                if self.model.cancel(id) {
                    self.senders.remove(&id);
                    self.shared.metrics.cancelled.inc();
                }
            }
            Command::Crash => {
                if self.model.health() == Health::Healthy {
                    self.model.crash(now, &mut self.events);
                    self.shared.injected_crashes.fetch_add(1, Ordering::Relaxed);
                }
            }
            Command::Hang(hang) => self.hung = hang,
            Command::Shutdown => self.stopped = true,
        }
    }

    /// Passes events to their requests and metrics, then publishes a fresh snapshot.
    fn flush(&mut self) {
        let m = &self.shared.metrics;
        for event in self.events.drain(..) {
            match event {
                Event::Admitted {
                    id,
                    prefill_tokens,
                    cached_tokens,
                    first,
                } => {
                    if self.model.params().prefix_caching {
                        m.prefix_cache_queries
                            .inc_by(u64::from(prefill_tokens + cached_tokens));
                        m.prefix_cache_hits.inc_by(u64::from(cached_tokens));
                    }
                    if first {
                        m.prompt_tokens
                            .inc_by(u64::from(prefill_tokens + cached_tokens));
                        if let Some(c) = self.senders.get(&id) {
                            let _ = c.events.send(SeqEvent::Admitted {
                                cached: cached_tokens,
                            });
                        }
                    }
                }
                Event::Preempted { .. } => {
                    m.preemptions.inc();
                }
                Event::Token { id, index, ttft } => {
                    m.generation_tokens.inc();
                    if let Some(ttft) = ttft {
                        m.ttft.observe(ttft.as_secs_f64());
                    }
                    if let Some(c) = self.senders.get(&id) {
                        // A closed receiver means the client left; its Cancel is on the way.
                        let _ = c.events.send(SeqEvent::Token(index));
                    }
                }
                Event::Finished { id, e2e, .. } => {
                    m.e2e.observe(e2e.as_secs_f64());
                    if let Some(c) = self.senders.remove(&id) {
                        m.success
                            .get_or_create(&FinishLabel {
                                finished_reason: c.finish_reason,
                            })
                            .inc();
                        let _ = c.events.send(SeqEvent::Finished);
                    }
                }
                Event::Failed { id, reason } => {
                    m.fail(match reason {
                        FailReason::Crash => "crash",
                        FailReason::Unavailable => "unavailable",
                        FailReason::Shutdown => "shutdown",
                    });
                    if let Some(c) = self.senders.remove(&id) {
                        let _ = c.events.send(SeqEvent::Failed(reason));
                    }
                }
                Event::Crashed { in_flight } => {
                    m.crashes.inc();
                    tracing::warn!(
                        in_flight,
                        restart_secs = self.model.params().restart_secs,
                        "simulated engine crashed (CUDA out of memory): all in-flight requests fail"
                    );
                }
                Event::Restarted => {
                    // A restart is a fresh process: whatever hung the old one is gone.
                    self.hung = false;
                    self.shared.faults.lock().hang = false;
                    tracing::info!("simulated engine restarted, empty");
                }
            }
        }
        let gpu = self.model.stats();
        let stats = EngineStats::new(
            &gpu,
            self.model.health(),
            self.hung,
            self.shared.clock.now(),
            &self.lag,
        );
        if self.shared.config.metrics_refresh_secs <= 0.0 {
            m.set_gauges(stats.running, stats.waiting, stats.kv_usage);
        }
        self.stats_tx.send_replace(stats);
    }

    fn stop(mut self) {
        self.model.fail_all(FailReason::Shutdown, &mut self.events);
        self.flush();
        self.stats_tx
            .send_modify(|s| s.state = EngineState::Stopped);
    }
}
