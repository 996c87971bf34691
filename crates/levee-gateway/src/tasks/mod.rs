//! Async tasks: `POST /v1/tasks` stores a chat or completion request durably and answers at
//! once (`202`, the task's id, place in line and ETA); the client polls `GET
//! /v1/tasks/{id}` or is called back.
//!
//! * **One admission path.** A task runs through the same phases as a client's request
//!   (`routes::serve_task`: classify → admit → dispatch → proxy → settle), admitted in the
//!   configured batch tier (`tasks.tier`), so the tenant's limits, the lane's watermarks, the
//!   fair queue and the KV budgets all apply to it.
//! * **The band.** At most `tasks.max_running` tasks hold a place in a fair queue or a
//!   backend at once (all models). The rest wait here; places go to tenants in turn
//!   ([`Band::next_due`]), each tenant's tasks in submission order. Together with
//!   the batch tier's low priority this keeps long jobs on idle capacity: interactive
//!   requests are always served first from the queue, and never find more than
//!   `max_running` backend slots taken by tasks.
//! * **Prefill isolation.** A task's long prompt stalls its engine for its whole prefill
//!   (no chunked prefill), so a dispatched task fences its backend until its first token
//!   is predicted ([`levee_policy::PrefillFit`], fitted from the lane's streamed responses):
//!   other requests go to the lane's other backends meanwhile. The band starts a lane's
//!   next task only once no backend of the lane is fenced and no task of the lane waits for
//!   a backend ([`Tasks::lane_shut`]): one task prefill per lane at a time.
//! * **Durability.** Every state change is one atomic write ([`TaskStore::update`]): a redb
//!   transaction on one replica's own store, after whose crash queued tasks come back in
//!   submission order and running ones are queued again (sent upstream at least once); or,
//!   with `[state] backend = "redis"`, a compare-and-set script in Redis, the work in a
//!   stream every replica reads through one consumer group (`crate::task_store_redis`):
//!   a replica takes tasks when its band has room, renews them every tick, and claims those
//!   a dead replica held past `tasks.visibility_ms`. Either way a final state is only
//!   written over an unfinished one, so each task gets exactly one final state.
//! * **Position and ETA.** A task in a fair queue reports its place in that queue's real
//!   serving order ([`levee_policy::FairQueue::position_of`]); one waiting for the band
//!   reports the tasks the band's turn order puts ahead of it ([`Band::ahead_of`]). The ETA divides the starts it waits for by the
//!   band's measured completion rate and adds the measured mean run time.
//! * **Callbacks** are POSTed on their own tokio task, signed with HMAC-SHA256 under the
//!   tenant's secret, and retried with full-jitter exponential backoff.

mod api;
mod callback;

pub(crate) use api::router;

use crate::config::TasksConfig;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;
use crate::lane::QueueSpot;
use crate::pipeline::{serve_task, Seat};
use crate::task_store::{CallbackState, Held, RedbStore, Status, StoreError, Task, TaskStore};
use axum::response::Response;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

/// Largest task response kept (a completion body).
const MAX_RESULT_BYTES: usize = 16 << 20;
/// What a task's answer makes of it: its result, a failure, or (the backend's own
/// backpressure) another try later.
async fn answered(resp: Response) -> Attempt {
    let status = resp.status();
    let advised = crate::upstream::advised_retry(resp.headers());
    let body = match axum::body::to_bytes(resp.into_body(), MAX_RESULT_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            let e = err_object(
                "upstream_error",
                &format!("the backend's response could not be read: {e}"),
            );
            return Attempt::Done(Status::Failed, None, Some(e));
        }
    };
    let v: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into()));
    if status.is_success() {
        Attempt::Done(Status::Succeeded, Some(v), None)
    } else if status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::SERVICE_UNAVAILABLE
    {
        Attempt::Retry(advised.unwrap_or(Duration::from_secs(1)))
    } else {
        let e = v.get("error").cloned().unwrap_or_else(|| {
            err_object("upstream_error", &format!("the backend answered {status}"))
        });
        Attempt::Done(Status::Failed, None, Some(e))
    }
}

/// Completions the band's drain rate looks back over.
const RATE_WINDOW: usize = 32;
/// Callback deliveries one replica runs at once that it took over from others.
const CALLBACKS_AT_ONCE: usize = 64;

/// The async task service of one gateway.
pub struct Tasks {
    store: Box<dyn TaskStore>,
    cfg: TasksConfig,
    band: Mutex<Band>,
    wake: Notify,
    /// Wakes the shared queue's reader (a band place freed, a task was submitted here).
    pull: Notify,
    /// This replica handed its tasks back (clean shutdown): it renews and claims no more.
    released: std::sync::atomic::AtomicBool,
    /// Tasks whose callbacks this replica is delivering.
    delivering: Mutex<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks").finish_non_exhaustive()
    }
}

/// In-memory view of what runs: rebuilt from the store at start.
#[derive(Default)]
struct Band {
    /// Tasks waiting for a place in the band, by submission sequence.
    waiting: BTreeMap<u64, Waiting>,
    /// Band places given to each tenant (a virtual counter: the backlogged tenant with the
    /// fewest goes next; a tenant that becomes backlogged starts at the smallest counter of
    /// those waiting, so idling banks no credit).
    turns: HashMap<Arc<str>, u64>,
    /// Tasks holding a place (in a fair queue or at a backend).
    live: HashMap<String, Live>,
    /// When recent tasks were dispatched and finished (Unix ms), for the band's drain rate.
    finished: VecDeque<(u64, u64)>,
    /// Mean run time (dispatch to result) of recent tasks, seconds (EWMA).
    service_s: Option<f64>,
    /// The task last given a place, until admission has queued or dispatched it: tasks
    /// enter admission one at a time, so they reach the fair queue in submission order.
    entering: Option<String>,
}

struct Waiting {
    id: String,
    tenant: Arc<str>,
    /// Its model's lane.
    model: Arc<str>,
    /// Not before this (a task refused for capacity waits its Retry-After).
    not_before: Option<Instant>,
}

struct Live {
    model: Arc<str>,
    spot: Arc<QueueSpot>,
    abort: Option<AbortHandle>,
    started: Option<Instant>,
}

impl Band {
    /// Puts a task in line for the band.
    fn enqueue(&mut self, seq: u64, w: Waiting) {
        let backlogged = self.waiting.values().any(|o| o.tenant == w.tenant);
        if !backlogged {
            let floor = self
                .waiting
                .values()
                .filter_map(|o| self.turns.get(&o.tenant).copied())
                .min();
            let own = self.turns.entry(w.tenant.clone()).or_default();
            if let Some(f) = floor {
                *own = (*own).max(f);
            }
        }
        self.waiting.insert(seq, w);
    }

    /// The next due waiting task whose lane may take one (`open`): the tenant with the
    /// fewest band places given, its oldest task (the oldest overall on a tie).
    fn next_due(&self, now: Instant, open: impl Fn(&str) -> bool) -> Option<u64> {
        self.waiting
            .iter()
            .filter(|(_, w)| w.not_before.is_none_or(|t| t <= now) && open(&w.model))
            .min_by_key(|(seq, w)| (self.turns.get(&w.tenant).copied().unwrap_or(0), **seq))
            .map(|(seq, _)| *seq)
    }

    /// Waiting tasks that go to the band before the task `seq` of `tenant`, by the same
    /// rule, if nothing else changes.
    fn ahead_of(&self, seq: u64, tenant: &Arc<str>) -> usize {
        let mut by_tenant: HashMap<&Arc<str>, Vec<u64>> = HashMap::new();
        for (s, w) in &self.waiting {
            by_tenant.entry(&w.tenant).or_default().push(*s);
        }
        let own = by_tenant.get(tenant).map_or(&[][..], |v| &v[..]);
        let rank = own.iter().take_while(|s| **s < seq).count() as u64;
        let turn = self.turns.get(tenant).copied().unwrap_or(0) + rank;
        let mut ahead = rank as usize;
        for (other, seqs) in &by_tenant {
            if *other == tenant {
                continue;
            }
            let start = self.turns.get(*other).copied().unwrap_or(0);
            // Its entries at counters below `turn` go first; at `turn`, the older goes first.
            let before = turn.saturating_sub(start) as usize;
            let mut n = before.min(seqs.len());
            if turn >= start && seqs.get(before).is_some_and(|s| *s < seq) {
                n += 1;
            }
            ahead += n;
        }
        ahead
    }
}

/// How one attempt at running a task ended.
enum Attempt {
    /// Final.
    Done(Status, Option<Value>, Option<Value>),
    /// Refused for capacity or quota: back in line after this long.
    Retry(Duration),
    /// The gateway is stopping, or the task is gone or final already: leave it as stored.
    Leave,
}

pub(super) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn store_failed(e: StoreError) -> GatewayError {
    tracing::error!("{e}");
    GatewayError::task_store_unavailable(&e.to_string())
}

fn err_object(code: &str, message: &str) -> Value {
    json!({"message": message, "type": "invalid_request_error", "code": code, "param": null})
}

impl Tasks {
    /// Tasks on `store`.
    fn with_store(cfg: &TasksConfig, store: Box<dyn TaskStore>) -> Tasks {
        Tasks {
            store,
            cfg: cfg.clone(),
            band: Mutex::new(Band::default()),
            wake: Notify::new(),
            pull: Notify::new(),
            released: std::sync::atomic::AtomicBool::new(false),
            delivering: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Opens this replica's own store at `cfg.store_path`.
    pub fn open(cfg: &TasksConfig) -> anyhow::Result<Tasks> {
        let store = RedbStore::open(&cfg.store_path)?;
        Ok(Tasks::with_store(cfg, Box::new(store)))
    }

    /// Tasks shared by the fleet on the Redis of `[state]`, this replica reading the queue
    /// as `replica`.
    pub fn open_shared(
        cfg: &TasksConfig,
        state: &crate::config::StateConfig,
        redacted_url: &str,
        replica: &str,
    ) -> anyhow::Result<Tasks> {
        let store = crate::task_store_redis::RedisTaskStore::new(
            &state.url,
            redacted_url,
            &state.key_prefix,
            replica,
            Duration::from_millis(cfg.visibility_ms.max(1)),
            Duration::from_millis(cfg.result_retention_ms),
            Duration::from_millis(cfg.max_queue_ms),
        )?;
        Ok(Tasks::with_store(cfg, Box::new(store)))
    }

    /// Re-queues what a previous run left queued or running (in submission order; a local
    /// store only), resumes undelivered callbacks, and starts the band's feeder, the
    /// expiry sweep and, on a shared queue, its reader.
    pub async fn start(self: Arc<Self>, gw: &Arc<Gateway>) -> anyhow::Result<()> {
        let recovered = self.store.recover().await?;
        for t in recovered {
            if t.status.is_final() {
                if t.callback.as_ref().is_some_and(|c| !c.done) {
                    self.clone().spawn_callback(gw, t);
                }
                continue;
            }
            self.band.lock().enqueue(
                t.seq,
                Waiting {
                    id: t.id,
                    tenant: Arc::from(t.tenant.as_str()),
                    model: Arc::from(t.model.as_str()),
                    not_before: None,
                },
            );
        }
        let weak = Arc::downgrade(gw);
        crate::lane::spawn_pump(
            self.clone(),
            |t| &t.wake,
            gw.stopped_token(),
            move |t| {
                let gw = weak.upgrade()?;
                t.clone().feed(&gw)
            },
        );
        if self.store.shared() {
            self.clone().spawn_reader(gw);
        }
        let stop = gw.stopped_token();
        let weak = Arc::downgrade(gw);
        let me = self;
        let every = Duration::from_millis((me.cfg.max_queue_ms / 4).clamp(20, 1_000));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
                let Some(gw) = weak.upgrade() else { break };
                if let Err(e) = me.sweep(&gw).await {
                    tracing::error!("task sweep: {e}");
                }
            }
        });
        Ok(())
    }

    /// How often a replica on a shared queue renews what it holds, looks for cancels made
    /// on other replicas and reads new work: a quarter of the visibility timeout, at most
    /// 200 ms, at least 20 ms.
    fn tick(&self) -> Duration {
        Duration::from_millis((self.cfg.visibility_ms / 4).clamp(20, 200))
    }

    /// The shared queue's reader: every tick (and when a band place frees or a task is
    /// submitted here) it renews the tasks this replica holds — dropping those finished or
    /// claimed elsewhere — and, when the band has room, claims that many tasks.
    fn spawn_reader(self: Arc<Self>, gw: &Arc<Gateway>) {
        let stop = gw.stopped_token();
        let weak = Arc::downgrade(gw);
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                let Some(gw) = weak.upgrade() else { break };
                match self.read_once(&gw).await {
                    Ok(()) if failing => {
                        failing = false;
                        tracing::info!("the shared task queue answers again");
                    }
                    Ok(()) => {}
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(
                            "shared task queue: {e}; this replica takes no new tasks until it \
                             answers"
                        );
                    }
                    Err(_) => {}
                }
                drop(gw);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(self.tick()) => {}
                    _ = self.pull.notified() => {}
                }
            }
        });
    }

    /// The tasks this replica holds: waiting for its band or placed.
    fn held(&self) -> Vec<String> {
        let band = self.band.lock();
        band.waiting
            .values()
            .map(|w| w.id.clone())
            .chain(band.live.keys().cloned())
            .collect()
    }

    /// Clean shutdown on a shared queue: hands the tasks this replica still holds back, so
    /// other replicas claim them at once rather than after `tasks.visibility_ms`.
    pub async fn leave(&self) {
        if !self.store.shared() {
            return;
        }
        self.released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let delivering: Vec<String> = self.delivering.lock().iter().cloned().collect();
        if let Err(e) = self.store.release_callbacks(&delivering).await {
            tracing::warn!(
                "could not hand {} callback deliveries back ({e}); other replicas take them \
                 over after tasks.visibility_ms",
                delivering.len()
            );
        }
        let held = self.held();
        if held.is_empty() {
            return;
        }
        match self.store.release(&held).await {
            Ok(()) => tracing::info!(
                "handed {} unfinished tasks back to the shared queue",
                held.len()
            ),
            Err(e) => tracing::warn!(
                "could not hand {} tasks back to the shared queue ({e}); other replicas \
                 claim them after tasks.visibility_ms",
                held.len()
            ),
        }
    }

    /// One round of the shared queue's reader.
    async fn read_once(self: &Arc<Self>, gw: &Arc<Gateway>) -> Result<(), StoreError> {
        if self.released.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let held = self.held();
        let kept = self.store.renew(&held).await?;
        for (id, h) in held.iter().zip(kept) {
            match h {
                Held::Kept => {}
                Held::Lost => {
                    tracing::warn!(
                        "task {id}: another replica claimed it (this one was silent past \
                         tasks.visibility_ms); letting it go"
                    );
                    self.withdraw(id);
                }
                Held::Finished => self.withdraw(id),
            }
        }
        // Callback deliveries: keep this replica's, take over those a stopped replica left.
        let delivering: Vec<String> = self.delivering.lock().iter().cloned().collect();
        let take = if gw.is_draining() {
            0
        } else {
            CALLBACKS_AT_ONCE.saturating_sub(delivering.len())
        };
        for t in self.store.callbacks(&delivering, take).await? {
            if t.status.is_final() && t.callback.as_ref().is_some_and(|c| !c.done) {
                tracing::info!("task {}: taking over its callback delivery", t.id);
                self.clone().spawn_callback(gw, t);
            } else {
                self.store.callback_done(&t.id).await?;
            }
        }
        if gw.is_draining() {
            return Ok(());
        }
        let free = {
            let band = self.band.lock();
            let width = usize::try_from(self.cfg.max_running).unwrap_or(usize::MAX);
            width.saturating_sub(band.live.len() + band.waiting.len())
        };
        if free == 0 {
            return Ok(());
        }
        let claimed = self.store.claim(free).await?;
        if claimed.reclaimed > 0 {
            tracing::warn!(
                "claimed {} tasks another replica held past tasks.visibility_ms (it stopped \
                 renewing them); running them here",
                claimed.reclaimed
            );
            gw.metrics()
                .tasks_reclaimed
                .inc_by(u64::try_from(claimed.reclaimed).unwrap_or(u64::MAX));
        }
        if claimed.tasks.is_empty() {
            return Ok(());
        }
        {
            let mut band = self.band.lock();
            for t in claimed.tasks {
                band.enqueue(
                    t.seq,
                    Waiting {
                        id: t.id,
                        tenant: Arc::from(t.tenant.as_str()),
                        model: Arc::from(t.model.as_str()),
                        not_before: None,
                    },
                );
            }
        }
        self.wake.notify_one();
        Ok(())
    }

    /// Gives free band places to due waiting tasks, fairly across tenants
    /// ([`Band::next_due`]), one lane's prefill at a time ([`Tasks::lane_shut`]). Returns
    /// when a waiting task becomes due or a lane's fence ends.
    fn feed(self: Arc<Self>, gw: &Arc<Gateway>) -> Option<Instant> {
        let now = Instant::now();
        let mut band = self.band.lock();
        let width = usize::try_from(self.cfg.max_running).unwrap_or(usize::MAX);
        let mut next_due = None;
        let mut shut_until: Option<Instant> = None;
        while band.live.len() < width && band.entering.is_none() {
            let mut shut = HashMap::new();
            for w in band.waiting.values() {
                if !shut.contains_key(&w.model) {
                    let s = self.lane_shut(gw, &band, &w.model);
                    if let Some(Some(t)) = s {
                        shut_until = Some(shut_until.map_or(t, |n: Instant| n.min(t)));
                    }
                    shut.insert(w.model.clone(), s.is_some());
                }
            }
            let open = |m: &str| !shut.get(m).copied().unwrap_or(false);
            let Some(seq) = band.next_due(now, open) else {
                break;
            };
            let Some(w) = band.waiting.remove(&seq) else {
                break;
            };
            *band.turns.entry(w.tenant.clone()).or_default() += 1;
            let spot = Arc::new(QueueSpot::default());
            spot.batch.store(true, Ordering::Relaxed);
            let handle = tokio::spawn(self.clone().work(
                gw.clone(),
                w.id.clone(),
                seq,
                w.tenant.clone(),
                w.model.clone(),
                spot.clone(),
            ));
            band.entering = Some(w.id.clone());
            band.live.insert(
                w.id,
                Live {
                    model: w.model,
                    spot,
                    abort: Some(handle.abort_handle()),
                    started: None,
                },
            );
        }
        if let Some(t) = shut_until {
            next_due = Some(t);
        }
        let state = |s: &str| crate::metrics::StateLabel { state: s.into() };
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let m = gw.metrics();
        m.task_band
            .get_or_create(&state("waiting"))
            .set(count(band.waiting.len()));
        m.task_band
            .get_or_create(&state("placed"))
            .set(count(band.live.len()));
        for w in band.waiting.values() {
            if let Some(t) = w.not_before.filter(|t| *t > now) {
                next_due = Some(next_due.map_or(t, |n: Instant| n.min(t)));
            }
        }
        next_due
    }

    /// Whether the lane of `model` may not take a task now, and until when if known: while
    /// a task of that lane has a band place but no backend yet (it enters admission or waits
    /// in the fair queue), or while a backend of the lane is fenced by a task's prefill
    /// (`Some(end)`). So the band puts one long prompt at a time on a lane's backends, and a
    /// lane with two or more always has one free of batch prefill for interactive requests.
    fn lane_shut(&self, gw: &Gateway, band: &Band, model: &Arc<str>) -> Option<Option<Instant>> {
        if band
            .live
            .values()
            .any(|l| l.model == *model && !l.spot.dispatched())
        {
            return Some(None);
        }
        let now = gw.now();
        let until = gw.lane(model)?.view(|l| l.fenced_until(now))?;
        Some(Some(gw.clock().instant_at(until)))
    }

    /// Runs one task once and files the outcome. Its band place frees when this ends,
    /// aborted or not.
    async fn work(
        self: Arc<Self>,
        gw: Arc<Gateway>,
        id: String,
        seq: u64,
        tenant: Arc<str>,
        model: Arc<str>,
        spot: Arc<QueueSpot>,
    ) {
        struct Place<'a>(&'a Tasks, &'a str);
        impl Drop for Place<'_> {
            fn drop(&mut self) {
                let mut band = self.0.band.lock();
                band.live.remove(self.1);
                if band.entering.as_deref() == Some(self.1) {
                    band.entering = None;
                }
                drop(band);
                self.0.wake.notify_one();
                self.0.pull.notify_one();
            }
        }
        let place = Place(&self, &id);
        let outcome = self.attempt(&gw, &id, &spot).await;
        match outcome {
            Attempt::Done(status, result, error) => {
                drop(place);
                self.finish(&gw, &id, status, result, error).await;
            }
            Attempt::Retry(after) => {
                let back = async {
                    self.store
                        .update(
                            &id,
                            Box::new(|t| {
                                if t.status != Status::Running {
                                    return false;
                                }
                                t.status = Status::Queued;
                                true
                            }),
                        )
                        .await?;
                    self.store.get(&id).await
                }
                .await;
                drop(place);
                let still_open = match back {
                    Ok(Some(t)) => !t.status.is_final(),
                    Ok(None) => false,
                    Err(e) => {
                        tracing::error!("task {id}: {e}");
                        true
                    }
                };
                if still_open {
                    self.band.lock().enqueue(
                        seq,
                        Waiting {
                            id: id.clone(),
                            tenant: tenant.clone(),
                            model: model.clone(),
                            not_before: Some(Instant::now() + after),
                        },
                    );
                    self.wake.notify_one();
                }
            }
            Attempt::Leave => {
                drop(place);
                // On a shared queue a task left unfinished (this replica is draining) goes
                // back to the queue at once, for another replica to take.
                if let Err(e) = self.store.release(std::slice::from_ref(&id)).await {
                    tracing::warn!("task {id}: could not hand it back to the shared queue: {e}");
                }
            }
        }
    }

    async fn attempt(self: &Arc<Self>, gw: &Arc<Gateway>, id: &str, spot: &QueueSpot) -> Attempt {
        let task = match self.store.get(id).await {
            Ok(Some(t)) if !t.status.is_final() => t,
            Ok(_) => return Attempt::Leave,
            Err(e) => {
                tracing::error!("task {id}: {e}");
                return Attempt::Retry(Duration::from_secs(1));
            }
        };
        let rt = gw.runtime();
        let Some(tenant) = rt.tenants.iter().find(|t| *t.name == *task.tenant).cloned() else {
            let e = err_object(
                "tenant_removed",
                "the task's tenant is no longer configured on this gateway",
            );
            return Attempt::Done(Status::Failed, None, Some(e));
        };
        let Some(tier) = rt.cfg.tiers.get(&self.cfg.tier) else {
            let e = err_object("no_task_tier", "tasks.tier names no configured tier");
            return Attempt::Done(Status::Failed, None, Some(e));
        };
        let seat = Seat {
            tier: self.cfg.tier.clone(),
            priority: tier.priority,
            sheddable: tier.sheddable,
            queue_updates: false,
            slo_miss: tier.slo_miss,
        };
        let path = if task.endpoint == "/v1/completions" {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let run = serve_task(gw, tenant, seat, task.body.as_bytes(), path, spot);
        tokio::pin!(run);
        let served = loop {
            tokio::select! {
                r = &mut run => break r,
                _ = spot.changed() => {
                    self.entered(id);
                    if spot.dispatched() {
                        // Its lane may take the next task (after its fence).
                        self.wake.notify_one();
                        self.mark_running(id).await;
                    }
                }
            }
        };
        if spot.dispatched() {
            self.mark_running(id).await;
        }
        match served {
            Ok(resp) => answered(resp).await,
            Err(e) if e.code() == ErrorCode::Draining => Attempt::Leave,
            Err(e) if e.refusal().is_some() && e.retryable() => {
                Attempt::Retry(e.retry_after().unwrap_or(Duration::from_secs(1)))
            }
            Err(e) => {
                let v = e.body_json();
                Attempt::Done(Status::Failed, None, v.get("error").cloned())
            }
        }
    }

    /// Admission has queued or dispatched `id`: the next task may enter.
    fn entered(&self, id: &str) {
        let mut band = self.band.lock();
        if band.entering.as_deref() == Some(id) {
            band.entering = None;
            drop(band);
            self.wake.notify_one();
        }
    }

    async fn mark_running(self: &Arc<Self>, id: &str) {
        {
            let mut band = self.band.lock();
            match band.live.get_mut(id) {
                Some(l) if l.started.is_none() => l.started = Some(Instant::now()),
                _ => return,
            }
        }
        let now = unix_ms();
        let r = self
            .store
            .update(
                id,
                Box::new(move |t| {
                    if t.status != Status::Queued {
                        return false;
                    }
                    t.status = Status::Running;
                    t.started_ms = Some(now);
                    t.attempts += 1;
                    true
                }),
            )
            .await;
        if let Err(e) = r {
            tracing::error!("task {id}: {e}");
        }
    }

    /// Moves a task to its final state, if nothing else did first; the one that does also
    /// sends the callback.
    async fn finish(
        self: &Arc<Self>,
        gw: &Arc<Gateway>,
        id: &str,
        status: Status,
        result: Option<Value>,
        error: Option<Value>,
    ) -> Option<Task> {
        let now = unix_ms();
        let done = self
            .store
            .update(
                id,
                Box::new(move |t| {
                    if t.status.is_final() {
                        return false;
                    }
                    t.status = status;
                    t.finished_ms = Some(now);
                    t.result.clone_from(&result);
                    t.error.clone_from(&error);
                    if t.callback_url.is_some() {
                        t.callback = Some(CallbackState::default());
                    }
                    true
                }),
            )
            .await;
        let done = match done {
            Ok(d) => d?,
            Err(e) => {
                tracing::error!("task {id}: {e}");
                return None;
            }
        };
        gw.metrics()
            .tasks_finished
            .get_or_create(&crate::metrics::StateLabel {
                state: status.as_str().into(),
            })
            .inc();
        {
            let mut band = self.band.lock();
            if status == Status::Succeeded {
                if let (Some(s), Some(f)) = (done.started_ms, done.finished_ms) {
                    band.finished.push_back((s, f));
                    while band.finished.len() > RATE_WINDOW {
                        band.finished.pop_front();
                    }
                    let run = f.saturating_sub(s) as f64 / 1000.0;
                    band.service_s = Some(match band.service_s {
                        Some(m) => 0.8 * m + 0.2 * run,
                        None => run,
                    });
                }
            }
        }
        if done.callback_url.is_some() {
            self.clone().spawn_callback(gw, done.clone());
        }
        Some(done)
    }

    /// Expires tasks queued too long, removes finished ones past retention.
    async fn sweep(self: &Arc<Self>, gw: &Arc<Gateway>) -> Result<(), StoreError> {
        let now = unix_ms();
        let before = now.saturating_sub(self.cfg.max_queue_ms);
        for t in self.store.queued_before(before).await? {
            let e = err_object(
                "task_expired",
                &format!(
                    "the task was still queued {} ms after submission (tasks.max_queue_ms)",
                    self.cfg.max_queue_ms
                ),
            );
            if self
                .finish(gw, &t.id, Status::Expired, None, Some(e))
                .await
                .is_some()
            {
                self.withdraw(&t.id);
            }
        }
        self.store
            .purge(now.saturating_sub(self.cfg.result_retention_ms))
            .await?;
        Ok(())
    }

    /// Takes a task out of the band (its worker is aborted: a request upstream is cut).
    fn withdraw(&self, id: &str) {
        let mut band = self.band.lock();
        let seq = band
            .waiting
            .iter()
            .find(|(_, w)| w.id == id)
            .map(|(s, _)| *s);
        if let Some(seq) = seq {
            band.waiting.remove(&seq);
        }
        if let Some(l) = band.live.remove(id) {
            if let Some(a) = l.abort {
                a.abort();
            }
        }
        if band.entering.as_deref() == Some(id) {
            band.entering = None;
        }
        drop(band);
        self.wake.notify_one();
        self.pull.notify_one();
    }

    /// Place in line (1 = next) and ETA (seconds) of an unfinished task. `fleet_ahead`: on
    /// a shared queue, the unfinished tasks ahead of it in the queue (for a task this
    /// replica does not hold).
    fn place(
        &self,
        gw: &Gateway,
        t: &Task,
        fleet_ahead: Option<usize>,
    ) -> (Option<usize>, Option<f64>) {
        let band = self.band.lock();
        let service = band.service_s;
        let width = f64::from(self.cfg.max_running.max(1));
        if let Some(l) = band.live.get(&t.id) {
            if let Some(started) = l.started {
                let left = service.map(|s| (s - started.elapsed().as_secs_f64()).max(0.0));
                return (None, left);
            }
            let Some((lane, p)) = l.spot.position() else {
                return (Some(1), service);
            };
            let now = gw.now();
            let rate = lane.view(|l| l.dispatch_rate(now));
            let eta = match service {
                Some(s) if rate > 0.0 => Some(p as f64 / rate + s),
                Some(s) => Some((p as f64 / width).ceil() * s + s),
                None => None,
            };
            return (Some(p), eta);
        }
        if !band.waiting.contains_key(&t.seq) {
            if !self.store.shared() {
                return (Some(1), service);
            }
            // Held by another replica, or not read from the queue yet: its place among
            // the fleet's unfinished tasks; they take the fleet's band places in turn.
            let Some(ahead) = fleet_ahead else {
                return (None, None);
            };
            let replicas = gw.shared().map_or(1, |s| s.live_replicas());
            let places = usize::try_from(self.cfg.max_running)
                .unwrap_or(usize::MAX)
                .saturating_mul(usize::try_from(replicas).unwrap_or(1));
            let starts = (ahead + 1).saturating_sub(places) as f64;
            let fleet_width = width * f64::from(replicas);
            let eta = match (service, drain_rate(&band.finished)) {
                (Some(s), Some(r)) => Some(starts / (r * f64::from(replicas)) + s),
                (Some(s), None) => Some((starts / fleet_width).ceil() * s + s),
                _ => None,
            };
            return (Some(ahead + 1), eta);
        }
        let ahead_waiting = band.ahead_of(t.seq, &Arc::from(t.tenant.as_str()));
        let in_queue = band.live.values().filter(|l| l.started.is_none()).count();
        let p = ahead_waiting + in_queue + 1;
        // Band places must free for it and every task ahead of it, less the places free now.
        let free = usize::try_from(self.cfg.max_running)
            .unwrap_or(usize::MAX)
            .saturating_sub(band.live.len());
        let starts = (ahead_waiting + 1).saturating_sub(free) as f64;
        let eta = match (service, drain_rate(&band.finished)) {
            (Some(s), Some(r)) => Some(starts / r + s),
            (Some(s), None) => Some((starts / width).ceil() * s + s),
            _ => None,
        };
        (Some(p), eta)
    }

    /// On a shared queue, for an unfinished task this replica does not hold: the
    /// unfinished tasks ahead of it in the queue (`None` when unknown or not needed).
    async fn fleet_ahead(&self, t: &Task) -> Option<usize> {
        if !self.store.shared() || t.status.is_final() {
            return None;
        }
        {
            let band = self.band.lock();
            if band.live.contains_key(&t.id) || band.waiting.contains_key(&t.seq) {
                return None;
            }
        }
        match self.store.ahead(&t.id).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("task {}: its place in the queue: {e}", t.id);
                None
            }
        }
    }

    /// The JSON a client sees for `t`.
    fn view(&self, gw: &Gateway, t: &Task) -> Value {
        self.view_at(gw, t, None)
    }

    /// [`Tasks::view`], with the task's place in the shared queue when known.
    fn view_at(&self, gw: &Gateway, t: &Task, fleet_ahead: Option<usize>) -> Value {
        let secs = |ms: Option<u64>| ms.map(|m| m / 1000);
        let mut v = json!({
            "id": t.id,
            "object": "task",
            "status": t.status,
            "model": t.model,
            "endpoint": t.endpoint,
            "created_at": t.created_ms / 1000,
            "started_at": secs(t.started_ms),
            "finished_at": secs(t.finished_ms),
            "attempts": t.attempts,
        });
        if !t.status.is_final() {
            let (position, eta) = self.place(gw, t, fleet_ahead);
            v["position"] = json!(position);
            v["eta_seconds"] = json!(eta.map(|e| (e * 10.0).round() / 10.0));
            v["poll_after_ms"] = json!(self.cfg.poll_interval_ms);
        }
        if let Some(r) = &t.result {
            v["result"] = r.clone();
        }
        if let Some(e) = &t.error {
            v["error"] = e.clone();
        }
        if let Some(url) = &t.callback_url {
            v["callback_url"] = json!(url);
        }
        if let Some(c) = &t.callback {
            v["callback"] = json!({"delivered": c.delivered, "attempts": c.attempts,
                "done": c.done, "last_error": c.last_error});
        }
        v
    }
}

/// The band's drain rate: tasks finished per second over the last [`RATE_WINDOW`] that
/// finished within a minute, counted from the earliest dispatch among them to the last
/// finish (so the first finishes of a band that ran tasks side by side do not look like a
/// burst, and the gaps between one task's end and the next one's dispatch are counted).
/// At least two tasks.
fn drain_rate(finished: &VecDeque<(u64, u64)>) -> Option<f64> {
    let now = unix_ms();
    let recent: Vec<(u64, u64)> = finished
        .iter()
        .copied()
        .filter(|(_, f)| now.saturating_sub(*f) < 60_000)
        .collect();
    if recent.len() < 2 {
        return None;
    }
    let from = recent.iter().map(|(s, _)| *s).min()?;
    let to = recent.iter().map(|(_, f)| *f).max()?;
    let span = to.saturating_sub(from) as f64 / 1000.0;
    (span > 0.0).then(|| recent.len() as f64 / span)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A lane that may not take a task (one of its tasks prefills) holds only its own
    /// tasks: the next due task of another lane goes, in the usual turn order.
    #[test]
    fn a_shut_lane_holds_only_its_own_tasks() {
        let mut band = Band::default();
        for (seq, (tenant, model)) in [("a", "m1"), ("a", "m2"), ("b", "m1"), ("b", "m2")]
            .iter()
            .enumerate()
        {
            let w = Waiting {
                id: format!("t{seq}"),
                tenant: Arc::from(*tenant),
                model: Arc::from(*model),
                not_before: None,
            };
            band.enqueue(seq as u64, w);
        }
        let now = Instant::now();
        assert_eq!(band.next_due(now, |_| true), Some(0));
        assert_eq!(band.next_due(now, |m| m != "m1"), Some(1));
        *band.turns.entry(Arc::from("a")).or_default() += 1;
        assert_eq!(band.next_due(now, |m| m != "m1"), Some(3));
        assert_eq!(band.next_due(now, |m| m != "m1" && m != "m2"), None);
    }

    /// `ahead_of` is the band's real order: feeding everything by `next_due` hands each task
    /// out exactly after the tasks `ahead_of` counted.
    #[test]
    fn ahead_of_matches_the_feeding_order() {
        let tenants: Vec<Arc<str>> = ["a", "b", "c"].iter().map(|t| Arc::from(*t)).collect();
        let mut x: u64 = 0x9e37_79b9;
        let mut next = move |n: u64| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % n
        };
        for _ in 0..200 {
            let mut band = Band::default();
            let count = 1 + next(30);
            for seq in 0..count {
                let tenant = tenants[next(3) as usize].clone();
                // Some tenants have had places already.
                if next(4) == 0 {
                    *band.turns.entry(tenant.clone()).or_default() += next(3);
                }
                let w = Waiting {
                    id: format!("t{seq}"),
                    tenant,
                    model: Arc::from("m"),
                    not_before: None,
                };
                band.enqueue(seq, w);
            }
            let predicted: Vec<(u64, usize)> = band
                .waiting
                .iter()
                .map(|(seq, w)| (*seq, band.ahead_of(*seq, &w.tenant)))
                .collect();
            let now = Instant::now();
            let mut order = Vec::new();
            while let Some(seq) = band.next_due(now, |_| true) {
                let w = band.waiting.remove(&seq).unwrap();
                *band.turns.entry(w.tenant).or_default() += 1;
                order.push(seq);
            }
            for (seq, ahead) in predicted {
                let at = order.iter().position(|s| *s == seq).unwrap();
                assert_eq!(at, ahead, "task {seq} in {order:?}");
            }
        }
    }
}
