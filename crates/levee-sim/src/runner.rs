//! The open-loop runner: sends every scheduled request at its intended time, whatever
//! happened to earlier ones, and records each outcome once.
//!
//! Hot path per request: one spawned task, one pre-built body, one pooled keep-alive
//! connection, one message to the recorder task. Nothing in it takes a lock except the
//! `backoff` client's retry budget, and only on failure.

use crate::arrivals::{self, Arrival};
use crate::exchange::{self, HttpClient};
use crate::recorder::{Kind, Record, Recorder, ReportHeader, TaskOutcome};
use crate::report::{FaultRecord, MetricSeries, Report};
use crate::scenario::{Behaviour, Scenario};
use crate::scrape;
use crate::text::{self, TextKind, TextMix};
use anyhow::Context;
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use http_body_util::Full;
use levee_client::{Backoff, Decision, Outcome, RetryBudget, RetryBudgetConfig, RetryPolicy};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What to flood, and where to look while flooding.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Target {
    /// Base URL requests go to, e.g. `http://127.0.0.1:8080` (plain HTTP).
    pub base_url: String,
    /// `(source name, URL)` of Prometheus `/metrics` endpoints to scrape, e.g.
    /// `("gateway", "http://127.0.0.1:9090/metrics")`; added to the scenario's own list.
    pub metrics: Vec<(String, String)>,
    /// Admin base URLs of engines, indexed by a fault's `engine`; e.g.
    /// `http://127.0.0.1:8001`. Named fault actions are POSTed under these.
    pub engine_admin: Vec<String>,
}

impl Target {
    /// A target with only a base URL.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            ..Self::default()
        }
    }
}

/// Knobs of one run that are not part of the scenario.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Show the live progress line on stderr.
    pub progress: bool,
    /// Overrides the scenario's seed.
    pub seed: Option<u64>,
    /// Overrides the scenario's `rate_scale`.
    pub rate_scale: Option<f64>,
    /// Overrides the scenario's `capacity_rps`.
    pub capacity_rps: Option<f64>,
    /// Overrides the model name of the scenario and of all its classes.
    pub model: Option<String>,
    /// Multiplies the scenario's timeline (see [`Scenario::scale_time`]); 0.5 runs a 60 s
    /// scenario in 30 s at the same rates.
    pub time_scale: Option<f64>,
    /// How long to wait for requests still in flight after the last scheduled send, before
    /// cancelling them. Default: the client timeout plus one second.
    pub drain: Option<Duration>,
    /// Cancelling this token ends the run early (e.g. on Ctrl-C): nothing more is sent,
    /// requests in flight are cancelled, and the report covers what happened so far (the
    /// unsent rest of the schedule is recorded as `cancelled`).
    pub stop: Option<CancellationToken>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            progress: true,
            seed: None,
            rate_scale: None,
            capacity_rps: None,
            model: None,
            time_scale: None,
            drain: None,
            stop: None,
        }
    }
}

/// Live counters for the progress line.
#[derive(Default)]
struct Counters {
    scheduled: AtomicU64,
    sent: AtomicU64,
    done: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    in_flight: AtomicU64,
    max_lag_us: AtomicU64,
}

/// Everything a request task needs, shared.
struct Ctx {
    client: HttpClient,
    uri: http::Uri,
    start: Instant,
    /// One `Authorization` header per tenant, built once.
    auth: Vec<HeaderValue>,
    /// Body before the messages, per class: `{"model":...,"messages":[`.
    body_head: Vec<Vec<u8>>,
    /// What each `(tenant, class)` writes its prompts in: `texts[tenant][class]`.
    texts: Vec<Vec<TextMix>>,
    stream: Vec<bool>,
    /// Each class's client behaviour (its own, or the scenario's).
    behaviours: Vec<Behaviour>,
    /// The target's base URL (async clients' `/v1/tasks`).
    base: String,
    timeout: Duration,
    max_attempts: u32,
    policy: RetryPolicy,
    budgets: Vec<Mutex<RetryBudget>>,
    jitter: Mutex<SmallRng>,
    slots: Arc<Semaphore>,
    tx: mpsc::UnboundedSender<Record>,
    counters: Counters,
    cancel: CancellationToken,
    tracker: TaskTracker,
    scenario: Scenario,
    end_ns: u64,
}

/// One earlier message of a session, resent with every later turn.
#[derive(Debug, Clone)]
struct Said {
    /// The assistant's answer (else the user's question).
    assistant: bool,
    text: String,
    /// Its tokens as the simulated engine counts them.
    tokens: u32,
}

/// One logical request (all its attempts).
#[derive(Debug, Clone)]
struct Req {
    intended_ns: u64,
    tenant: u16,
    class: u16,
    prompt_tokens: u32,
    max_tokens: u32,
    turns_left: u16,
    /// Seeds the session's own generator, so later turns are repeatable too.
    session_seed: u64,
    /// A later turn's earlier messages (question, answer, question, ...), oldest first;
    /// `prompt_tokens` is then the new question's.
    history: Option<Arc<Vec<Said>>>,
}

/// Mixed into a request's seed for its prompt text.
const TEXT_SEED: u64 = 0x7465_7874;

fn ns_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl Ctx {
    /// The prompt of `req`: `prompt_tokens` tokens (as the simulated engine counts them)
    /// of its tenant's or class's text, seeded by the request.
    fn prompt(&self, req: &Req) -> String {
        let mut rng = SmallRng::seed_from_u64(req.session_seed ^ TEXT_SEED);
        let kind = self
            .texts
            .get(usize::from(req.tenant))
            .and_then(|t| t.get(usize::from(req.class)))
            .map_or(TextKind::English, |mix| mix.draw(&mut rng));
        text::generate(kind, req.prompt_tokens, &mut rng)
    }

    fn body(&self, req: &Req) -> Bytes {
        let class = usize::from(req.class);
        let head = self.body_head.get(class).map_or(&[][..], |h| &h[..]);
        let prompt = self.prompt(req);
        let mut out = Vec::with_capacity(head.len() + prompt.len() + 160);
        out.extend_from_slice(head);
        // Writing a string into a Vec cannot fail.
        for said in req.history.iter().flat_map(|h| h.iter()) {
            out.extend_from_slice(if said.assistant {
                b"{\"role\":\"assistant\",\"content\":"
            } else {
                b"{\"role\":\"user\",\"content\":"
            });
            let _ = serde_json::to_writer(&mut out, &said.text);
            out.extend_from_slice(b"},");
        }
        out.extend_from_slice(b"{\"role\":\"user\",\"content\":");
        let _ = serde_json::to_writer(&mut out, &prompt);
        // An async client's task is never streamed.
        let stream = self.stream.get(class).copied().unwrap_or(false)
            && self.behaviours.get(class) != Some(&Behaviour::Async);
        out.extend_from_slice(b"}],\"max_tokens\":");
        out.extend_from_slice(req.max_tokens.to_string().as_bytes());
        if stream {
            out.extend_from_slice(b",\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
        } else {
            out.extend_from_slice(b",\"stream\":false}");
        }
        Bytes::from(out)
    }

    fn request(&self, req: &Req, body: Bytes) -> anyhow::Result<http::Request<Full<Bytes>>> {
        let mut builder =
            http::Request::post(self.uri.clone()).header(CONTENT_TYPE, "application/json");
        if let Some(auth) = self.auth.get(usize::from(req.tenant)) {
            builder = builder.header(AUTHORIZATION, auth.clone());
        }
        builder
            .body(Full::new(body))
            .context("cannot build the HTTP request")
    }
}

/// Runs a scenario against a target and returns its report.
///
/// Every scheduled request is sent at its intended time (open loop) and produces exactly
/// one outcome in the report: success, an error by kind, or `cancelled` if the run's drain
/// time ran out first.
pub async fn run(
    scenario: &Scenario,
    target: &Target,
    opts: &RunOptions,
) -> anyhow::Result<Report> {
    let mut scenario = scenario.clone();
    if let Some(seed) = opts.seed {
        scenario.seed = seed;
    }
    if let Some(scale) = opts.rate_scale {
        scenario.rate_scale = scale;
    }
    if let Some(capacity) = opts.capacity_rps {
        scenario.capacity_rps = capacity;
    }
    if let Some(f) = opts.time_scale {
        scenario.scale_time(f);
    }
    if let Some(model) = &opts.model {
        scenario.request.model = model.clone();
        for class in &mut scenario.classes {
            class.model = None;
        }
    }
    scenario.validate()?;
    let schedule = arrivals::build(&scenario)?;

    let base = target.base_url.trim_end_matches('/');
    anyhow::ensure!(
        base.starts_with("http://"),
        "target {base:?}: levee sim speaks plain HTTP only; give a URL like http://127.0.0.1:8080"
    );
    let uri: http::Uri = format!("{base}{}", scenario.request.path)
        .parse()
        .with_context(|| {
            format!(
                "target {base:?} with path {:?} is not a valid URL",
                scenario.request.path
            )
        })?;

    let (tx, mut rx) = mpsc::unbounded_channel::<Record>();
    let start = Instant::now();
    let started_at = httpdate::fmt_http_date(std::time::SystemTime::now());
    let ctx = Arc::new(build_ctx(&scenario, uri, base, start, tx, &schedule)?);

    // The recorder owns all measurement state and returns it when every sender is gone.
    let mut recorder = Recorder::new(&scenario)?;
    let recorder_task = tokio::spawn(async move {
        while let Some(record) = rx.recv().await {
            recorder.record(record);
        }
        recorder
    });

    let stop_side = CancellationToken::new();
    let mut sources: Vec<(String, String)> = target.metrics.clone();
    sources.extend(
        scenario
            .metrics
            .urls
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    let scraper = tokio::spawn(scrape::run(
        ctx.client.clone(),
        sources,
        scenario.metrics.gauges.clone(),
        Duration::from_millis(scenario.metrics.interval_ms.max(10)),
        start,
        stop_side.clone(),
    ));
    let faults = tokio::spawn(run_faults(
        ctx.client.clone(),
        scenario.clone(),
        target.engine_admin.clone(),
        start,
        stop_side.clone(),
    ));
    let progress = tokio::spawn(show_progress(
        ctx.clone(),
        schedule.arrivals.len() as u64,
        opts.progress,
        stop_side.clone(),
    ));

    let drain = opts
        .drain
        .unwrap_or_else(|| Duration::from_secs_f64(scenario.client.timeout_s + 1.0));
    let drain_end = start + Duration::from_secs_f64(schedule.duration_s) + drain;

    // The dispatcher: the only place that waits for the schedule. It takes a send slot
    // before spawning, so that a sender that fell behind keeps its backlog in the schedule
    // (a few bytes per request) rather than in parked tasks, and memory stays bounded.
    let stop = opts.stop.clone().unwrap_or_default();
    for (i, a) in schedule.arrivals.iter().enumerate() {
        let due = start + Duration::from_nanos(a.at_ns);
        let mut permit = None;
        if due > Instant::now() {
            tokio::select! {
                _ = tokio::time::sleep_until(due) => {}
                _ = stop.cancelled() => {}
            }
        }
        if !stop.is_cancelled() {
            permit = match ctx.slots.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => tokio::select! {
                    p = ctx.slots.clone().acquire_owned() => p.ok(),
                    _ = tokio::time::sleep_until(drain_end) => None,
                    _ = stop.cancelled() => None,
                },
            };
        }
        let Some(permit) = permit else {
            // Stopped, or out of time with requests never sent: each is still recorded,
            // as cancelled.
            tracing::warn!(
                "{} scheduled requests not sent: {}",
                schedule.arrivals.len() - i,
                if stop.is_cancelled() {
                    "the run was stopped"
                } else {
                    "the drain time ended with all send slots busy"
                }
            );
            let now = ns_since(start);
            for rest in &schedule.arrivals[i..] {
                ctx.counters.scheduled.fetch_add(1, Ordering::Relaxed);
                ctx.counters.done.fetch_add(1, Ordering::Relaxed);
                ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
                let _ = ctx
                    .tx
                    .send(cancelled(&to_req(rest, scenario.seed), None, now));
            }
            break;
        };
        let req = to_req(a, scenario.seed);
        let task_ctx = ctx.clone();
        ctx.tracker.spawn(run_request(task_ctx, req, Some(permit)));
    }
    if stop.is_cancelled() {
        ctx.cancel.cancel();
    }
    ctx.tracker.close();
    let drained = tokio::select! {
        r = tokio::time::timeout_at(drain_end, ctx.tracker.wait()) => r.is_ok(),
        _ = stop.cancelled() => false,
    };
    if !drained {
        tracing::info!(
            "{}: cancelling the requests still in flight",
            if stop.is_cancelled() {
                "run stopped"
            } else {
                "drain time over"
            }
        );
        ctx.cancel.cancel();
        ctx.tracker.wait().await;
    }
    let wall_s = start.elapsed().as_secs_f64();
    stop_side.cancel();
    let metrics: Vec<MetricSeries> = scraper.await.context("the metrics scraper failed")?;
    let fault_records: Vec<FaultRecord> = faults.await.context("the fault injector failed")?;
    let _ = progress.await;
    // Every request task has finished; dropping the last sender lets the recorder end.
    drop(ctx);
    let recorder = recorder_task.await.context("the recorder failed")?;
    Ok(recorder.finish(
        ReportHeader {
            scenario: scenario.name.clone(),
            description: scenario.description.clone(),
            seed: scenario.seed,
            target: base.to_string(),
            started_at,
            duration_s: schedule.duration_s,
            wall_s,
            client: behaviour_name(scenario.client.behaviour).into(),
            faults: fault_records,
        },
        metrics,
    ))
}

fn behaviour_name(b: Behaviour) -> &'static str {
    match b {
        Behaviour::None => "none",
        Behaviour::Naive => "naive",
        Behaviour::Backoff => "backoff",
        Behaviour::Async => "async",
    }
}

fn to_req(a: &Arrival, seed: u64) -> Req {
    Req {
        intended_ns: a.at_ns,
        tenant: a.tenant,
        class: a.class,
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.max_tokens,
        turns_left: a.turns.saturating_sub(1),
        session_seed: seed ^ a.at_ns.rotate_left(17),
        history: None,
    }
}

fn build_ctx(
    scenario: &Scenario,
    uri: http::Uri,
    base: &str,
    start: Instant,
    tx: mpsc::UnboundedSender<Record>,
    schedule: &arrivals::Schedule,
) -> anyhow::Result<Ctx> {
    let auth = scenario
        .tenants
        .iter()
        .map(|t| {
            HeaderValue::from_str(&format!("Bearer {}", t.api_key)).with_context(|| {
                format!("tenant {:?}: api_key is not a valid header value", t.name)
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut body_head = Vec::new();
    for c in &scenario.classes {
        let mut head = serde_json::Map::new();
        let model = c
            .model
            .clone()
            .unwrap_or_else(|| scenario.request.model.clone());
        head.insert("model".into(), serde_json::Value::String(model));
        for (k, v) in scenario.request.extra.iter().chain(&c.extra) {
            head.insert(k.clone(), v.clone());
        }
        let mut text = serde_json::to_string(&serde_json::Value::Object(head))
            .context("cannot serialise the request body")?;
        // Reopen the object to append the messages and the per-request fields.
        text.pop();
        text.push_str(",\"messages\":[");
        body_head.push(text.into_bytes());
    }
    let c = &scenario.client;
    let c_behaviour = c.behaviour;
    let policy = RetryPolicy {
        backoff: Backoff {
            base: Duration::from_millis(c.backoff_base_ms),
            cap: Duration::from_millis(c.backoff_cap_ms),
            multiplier: 2.0,
        },
        max_attempts: c.max_attempts,
        max_retry_after: Duration::from_secs_f64(c.max_retry_after_s.max(0.0)),
        ..RetryPolicy::default()
    };
    let budget = RetryBudgetConfig {
        ratio: c.budget_ratio,
        min_per_sec: c.budget_min_per_sec,
        max_tokens: c.budget_max_tokens,
    };
    let now = std::time::Instant::now();
    Ok(Ctx {
        client: exchange::http_client(),
        uri,
        start,
        auth,
        body_head,
        stream: scenario.classes.iter().map(|c| c.stream).collect(),
        behaviours: scenario
            .classes
            .iter()
            .map(|c| c.behaviour.unwrap_or(c_behaviour))
            .collect(),
        base: base.to_string(),
        texts: scenario
            .tenants
            .iter()
            .map(|t| {
                scenario
                    .classes
                    .iter()
                    .map(|c| {
                        t.text
                            .clone()
                            .or_else(|| c.text.clone())
                            .unwrap_or_else(|| TextMix::one(TextKind::English))
                    })
                    .collect()
            })
            .collect(),
        timeout: Duration::from_secs_f64(c.timeout_s),
        max_attempts: c.max_attempts,
        policy,
        budgets: scenario
            .tenants
            .iter()
            .map(|_| Mutex::new(RetryBudget::new(budget, now)))
            .collect(),
        jitter: Mutex::new(SmallRng::seed_from_u64(scenario.seed ^ 0x6a69_7474)),
        slots: Arc::new(Semaphore::new(c.max_in_flight)),
        tx,
        counters: Counters::default(),
        cancel: CancellationToken::new(),
        tracker: TaskTracker::new(),
        scenario: scenario.clone(),
        end_ns: (schedule.duration_s * 1e9) as u64,
    })
}

async fn run_request(ctx: Arc<Ctx>, req: Req, permit: Option<OwnedSemaphorePermit>) {
    ctx.counters.scheduled.fetch_add(1, Ordering::Relaxed);
    let (record, answer) = execute(&ctx, &req, permit).await;
    let ok = record.kind == Kind::Ok;
    let done_ns = record.done_ns;
    ctx.counters.done.fetch_add(1, Ordering::Relaxed);
    if ok {
        ctx.counters.ok.fetch_add(1, Ordering::Relaxed);
    } else {
        ctx.counters.failed.fetch_add(1, Ordering::Relaxed);
    }
    // The recorder only goes away after all request tasks ended, so this cannot fail
    // while it matters.
    let _ = ctx.tx.send(record);
    if ok && req.turns_left > 0 {
        schedule_next_turn(&ctx, &req, done_ns, answer);
    }
}

/// Template tokens per chat message and per chat prompt in the simulated engine.
const PER_MESSAGE: u32 = levee_engine::tokenizer::CHAT_TOKENS_PER_MESSAGE;
const PER_PROMPT: u32 = levee_engine::tokenizer::CHAT_TOKENS_PER_PROMPT;

/// A session's next turn: after a think time, the history (every earlier question and
/// answer, as separate messages) and a new question (`sessions.follow_up_tokens`, else the
/// class's `prompt_tokens`). Turns that would start after the run
/// ends are dropped before they are scheduled (they were never offered).
fn schedule_next_turn(ctx: &Arc<Ctx>, req: &Req, done_ns: u64, answer: String) {
    let mut rng = SmallRng::seed_from_u64(req.session_seed);
    let think = ctx.scenario.sessions.think_time_s.sample(&mut rng);
    let intended_ns = done_ns.saturating_add((think * 1e9) as u64);
    if intended_ns >= ctx.end_ns || ctx.cancel.is_cancelled() {
        return;
    }
    let class = &ctx.scenario.classes[usize::from(req.class).min(ctx.scenario.classes.len() - 1)];
    let question = ctx
        .scenario
        .sessions
        .follow_up_tokens
        .as_ref()
        .unwrap_or(&class.prompt_tokens)
        .sample(&mut rng)
        .round()
        .max(1.0) as u32;
    let max_tokens = class.max_tokens.sample(&mut rng).round().max(1.0) as u32;
    let mut history: Vec<Said> = req.history.as_deref().cloned().unwrap_or_default();
    history.push(Said {
        assistant: false,
        text: ctx.prompt(req),
        tokens: req.prompt_tokens,
    });
    history.push(Said {
        assistant: true,
        tokens: levee_engine::tokenizer::count_text(&answer),
        text: answer,
    });
    if let Some(window) = ctx.scenario.sessions.context_tokens {
        // Drop the oldest question and its answer, then the next, until the history, the
        // new question, the template's tokens and the answer fit in the window.
        let fixed = PER_PROMPT + PER_MESSAGE + question + max_tokens;
        let mut total: u32 = history.iter().map(|m| m.tokens + PER_MESSAGE).sum();
        let mut dropped = 0;
        while fixed + total > window && dropped < history.len() {
            total -= history[dropped].tokens + PER_MESSAGE;
            dropped += 1;
            if history.get(dropped).is_some_and(|m| m.assistant) {
                total -= history[dropped].tokens + PER_MESSAGE;
                dropped += 1;
            }
        }
        history.drain(..dropped);
    }
    let next = Req {
        intended_ns,
        prompt_tokens: question,
        max_tokens,
        turns_left: req.turns_left - 1,
        session_seed: req
            .session_seed
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .wrapping_add(1),
        history: (!history.is_empty()).then(|| Arc::new(history)),
        ..req.clone()
    };
    let task_ctx = ctx.clone();
    // The tracker may already be closed (the dispatcher finished); spawning on a closed
    // tracker is still tracked, which is what keeps the drain waiting for this turn.
    ctx.tracker.spawn(async move {
        let due = task_ctx.start + Duration::from_nanos(next.intended_ns);
        tokio::select! {
            _ = tokio::time::sleep_until(due) => run_request(task_ctx, next, None).await,
            _ = task_ctx.cancel.cancelled() => {
                task_ctx.counters.scheduled.fetch_add(1, Ordering::Relaxed);
                let now = ns_since(task_ctx.start);
                let _ = task_ctx.tx.send(cancelled(&next, None, now));
            }
        }
    });
}

fn cancelled(req: &Req, first_sent_ns: Option<u64>, now: u64) -> Record {
    Record {
        intended_ns: req.intended_ns,
        first_sent_ns,
        last_sent_ns: first_sent_ns.unwrap_or(now),
        retry_sent_ns: Vec::new(),
        done_ns: now,
        first_token_ns: None,
        tokens: 0,
        itl_us: Vec::new(),
        kind: Kind::Cancelled,
        admitted: false,
        attempts: u32::from(first_sent_ns.is_some()),
        tenant: req.tenant,
        class: req.class,
        task: None,
    }
}

/// All attempts of one request, with the client behaviour's retries. `first_permit` is the
/// send slot the dispatcher already took for the first attempt, if any.
/// Also returns the answer's text when the request is a session turn with turns after it
/// (empty otherwise).
async fn execute(
    ctx: &Ctx,
    req: &Req,
    first_permit: Option<OwnedSemaphorePermit>,
) -> (Record, String) {
    let mut answer = String::new();
    let record = attempts(ctx, req, first_permit, &mut answer).await;
    (record, answer)
}

async fn attempts(
    ctx: &Ctx,
    req: &Req,
    mut first_permit: Option<OwnedSemaphorePermit>,
    answer: &mut String,
) -> Record {
    let behaviour = ctx
        .behaviours
        .get(usize::from(req.class))
        .copied()
        .unwrap_or(Behaviour::None);
    if behaviour == Behaviour::Async {
        return execute_task(ctx, req, first_permit, answer).await;
    }
    let body = ctx.body(req);
    let tenant = usize::from(req.tenant);
    if behaviour == Behaviour::Backoff {
        if let Some(b) = ctx.budgets.get(tenant) {
            b.lock()
                .unwrap_or_else(|e| e.into_inner())
                .on_request(std::time::Instant::now());
        }
    }
    let mut first_sent_ns = None;
    let mut retry_sent_ns = Vec::new();
    let mut attempts = 0u32;
    let mut admitted = false;
    loop {
        // A slot bounds sockets; waiting for one delays the send, which the lag records.
        let permit = match first_permit.take() {
            Some(p) => Some(p),
            None => tokio::select! {
                p = ctx.slots.clone().acquire_owned() => p.ok(),
                _ = ctx.cancel.cancelled() => None,
            },
        };
        let Some(_permit) = permit else {
            return cancelled(req, first_sent_ns, ns_since(ctx.start));
        };
        let sent_ns = ns_since(ctx.start);
        attempts += 1;
        if first_sent_ns.is_none() {
            first_sent_ns = Some(sent_ns);
            ctx.counters.sent.fetch_add(1, Ordering::Relaxed);
            let lag_us = sent_ns.saturating_sub(req.intended_ns) / 1000;
            ctx.counters.max_lag_us.fetch_max(lag_us, Ordering::Relaxed);
        } else {
            retry_sent_ns.push(sent_ns);
        }
        let request = match ctx.request(req, body.clone()) {
            Ok(r) => r,
            Err(_) => {
                let mut r = cancelled(req, first_sent_ns, sent_ns);
                r.kind = Kind::Connect;
                return r;
            }
        };
        ctx.counters.in_flight.fetch_add(1, Ordering::Relaxed);
        let got_2xx = AtomicBool::new(false);
        let keep = req.turns_left > 0;
        let exchange = exchange::attempt(&ctx.client, request, ctx.start, &got_2xx, keep);
        let result = tokio::select! {
            r = tokio::time::timeout(ctx.timeout, exchange) => r.ok(),
            _ = ctx.cancel.cancelled() => {
                ctx.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
                let mut r = cancelled(req, first_sent_ns, ns_since(ctx.start));
                r.attempts = attempts;
                r.retry_sent_ns = retry_sent_ns;
                r.admitted = admitted || got_2xx.load(Ordering::Relaxed);
                return r;
            }
        };
        ctx.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        drop(_permit);
        let done_ns = ns_since(ctx.start);
        let result = result.unwrap_or_else(|| exchange::AttemptResult {
            kind: Kind::Timeout,
            admitted: false,
            first_token_ns: None,
            tokens: 0,
            itl_us: Vec::new(),
            retry_after: None,
            content: String::new(),
        });
        admitted |= result.admitted || got_2xx.load(Ordering::Relaxed);
        let outcome = match &result.kind {
            Kind::Ok => None,
            Kind::RateLimited(_) => Some(Outcome::Status(429)),
            Kind::Status(s) | Kind::LeveeStatus(s) => Some(Outcome::Status(*s)),
            Kind::Timeout => Some(Outcome::Timeout),
            Kind::Connect | Kind::BrokenStream => Some(Outcome::Connect),
            Kind::Cancelled | Kind::Task(_) => None,
        };
        let retry = match (outcome, behaviour) {
            (None, _) | (_, Behaviour::None | Behaviour::Async) => None,
            (Some(o), Behaviour::Naive) => {
                (o.is_retryable() && attempts < ctx.max_attempts).then_some(Duration::ZERO)
            }
            (Some(o), Behaviour::Backoff) => {
                let decision = match ctx.budgets.get(tenant) {
                    Some(b) => {
                        let mut budget = b.lock().unwrap_or_else(|e| e.into_inner());
                        let mut rng = ctx.jitter.lock().unwrap_or_else(|e| e.into_inner());
                        ctx.policy.decide(
                            attempts,
                            o,
                            result.retry_after,
                            &mut budget,
                            std::time::Instant::now(),
                            &mut *rng,
                        )
                    }
                    None => Decision::GiveUp(levee_client::GiveUp::NotRetryable),
                };
                match decision {
                    Decision::Retry(d) => Some(d),
                    Decision::GiveUp(_) => None,
                }
            }
        };
        match retry {
            Some(delay) => {
                if !delay.is_zero() {
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = ctx.cancel.cancelled() => {
                            let mut r = cancelled(req, first_sent_ns, ns_since(ctx.start));
                            r.attempts = attempts;
                            r.retry_sent_ns = retry_sent_ns;
                            r.admitted = admitted;
                            return r;
                        }
                    }
                }
            }
            None => {
                *answer = result.content;
                return Record {
                    intended_ns: req.intended_ns,
                    first_sent_ns,
                    last_sent_ns: sent_ns,
                    retry_sent_ns,
                    done_ns,
                    first_token_ns: result.first_token_ns,
                    tokens: result.tokens,
                    itl_us: result.itl_us,
                    kind: result.kind,
                    admitted,
                    attempts,
                    tenant: req.tenant,
                    class: req.class,
                    task: None,
                };
            }
        }
    }
}

/// Calls the fault schedule's URLs at their times.
/// An async client: submit to `/v1/tasks`, poll at the advised interval until the task is
/// final (or the run ends), take the result.
async fn execute_task(
    ctx: &Ctx,
    req: &Req,
    first_permit: Option<OwnedSemaphorePermit>,
    answer: &mut String,
) -> Record {
    let mut record = cancelled(req, None, ns_since(ctx.start));
    let permit = match first_permit {
        Some(p) => Some(p),
        None => tokio::select! {
            p = ctx.slots.clone().acquire_owned() => p.ok(),
            _ = ctx.cancel.cancelled() => None,
        },
    };
    let Some(permit) = permit else {
        return record;
    };
    let sent_ns = ns_since(ctx.start);
    ctx.counters.sent.fetch_add(1, Ordering::Relaxed);
    let lag_us = sent_ns.saturating_sub(req.intended_ns) / 1000;
    ctx.counters.max_lag_us.fetch_max(lag_us, Ordering::Relaxed);
    record.first_sent_ns = Some(sent_ns);
    record.last_sent_ns = sent_ns;
    record.attempts = 1;
    let auth = ctx.auth.get(usize::from(req.tenant)).cloned();
    let mut outcome = TaskOutcome {
        state: "refused",
        accepted: false,
        eta_s: None,
        took_s: 0.0,
    };
    let submit_url = format!("{}/v1/tasks", ctx.base);
    let submit = exchange::call_json(
        &ctx.client,
        http::Method::POST,
        &submit_url,
        auth.clone(),
        Some(ctx.body(req)),
    );
    let submitted = tokio::select! {
        r = tokio::time::timeout(ctx.timeout, submit) => r.unwrap_or(Err(Kind::Timeout)),
        _ = ctx.cancel.cancelled() => return record,
    };
    drop(permit);
    let task = match submitted {
        Ok((202, v)) => v,
        Ok((_, _)) | Err(_) => {
            record.done_ns = ns_since(ctx.start);
            record.kind = match submitted {
                Err(k) => k,
                Ok((429, v)) => {
                    Kind::RateLimited(v["error"]["code"].as_str().unwrap_or("unknown").to_string())
                }
                Ok((status, _)) => Kind::Status(status),
            };
            record.task = Some(outcome);
            return record;
        }
    };
    record.admitted = true;
    outcome.accepted = true;
    outcome.eta_s = task["eta_seconds"].as_f64();
    let Some(id) = task["id"].as_str().map(str::to_string) else {
        outcome.state = "lost";
        record.kind = Kind::Task("lost");
        record.task = Some(outcome);
        return record;
    };
    let url = format!("{}/v1/tasks/{id}", ctx.base);
    let mut poll_ms = task["poll_after_ms"].as_u64().unwrap_or(1000);
    let mut failures = 0;
    let last = loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(poll_ms.clamp(10, 60_000))) => {}
            _ = ctx.cancel.cancelled() => {
                outcome.state = "unfinished";
                outcome.took_s = ns_since(ctx.start).saturating_sub(sent_ns) as f64 / 1e9;
                record.done_ns = ns_since(ctx.start);
                record.task = Some(outcome);
                return record;
            }
        }
        match exchange::call_json(&ctx.client, http::Method::GET, &url, auth.clone(), None).await {
            Ok((200, v)) => {
                failures = 0;
                let state = v["status"].as_str().unwrap_or("");
                if !matches!(state, "queued" | "running") {
                    break v;
                }
                poll_ms = v["poll_after_ms"].as_u64().unwrap_or(poll_ms);
            }
            _ => {
                failures += 1;
                if failures >= 5 {
                    break serde_json::json!({"status": "lost"});
                }
            }
        }
    };
    let done_ns = ns_since(ctx.start);
    record.done_ns = done_ns;
    outcome.took_s = done_ns.saturating_sub(sent_ns) as f64 / 1e9;
    outcome.state = match last["status"].as_str() {
        Some("succeeded") => "succeeded",
        Some("failed") => "failed",
        Some("cancelled") => "cancelled",
        Some("expired") => "expired",
        _ => "lost",
    };
    if outcome.state == "succeeded" {
        record.kind = Kind::Ok;
        record.first_token_ns = Some(done_ns);
        record.tokens = last["result"]["usage"]["completion_tokens"]
            .as_u64()
            .map_or(0, |t| u32::try_from(t).unwrap_or(u32::MAX));
        if req.turns_left > 0 {
            if let Some(text) = last["result"]["choices"][0]["message"]["content"].as_str() {
                *answer = text.to_string();
            }
        }
    } else {
        record.kind = Kind::Task(outcome.state);
    }
    record.task = Some(outcome);
    record
}

async fn run_faults(
    client: HttpClient,
    scenario: Scenario,
    engine_admin: Vec<String>,
    start: Instant,
    stop: CancellationToken,
) -> Vec<FaultRecord> {
    let faults = crate::faults::expand(&scenario.faults);
    let mut records = Vec::new();
    for f in faults {
        let due = start + Duration::from_secs_f64(f.at_s.max(0.0));
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {}
            _ = stop.cancelled() => break,
        }
        let (url, body) = crate::faults::request_for(&f, &engine_admin);
        let mut record = FaultRecord {
            at_s: f.at_s,
            action: crate::faults::action_name(f.action).into(),
            url: url.clone().unwrap_or_default(),
            body: body.clone(),
            status: None,
            error: None,
        };
        match url {
            None => {
                record.error = Some(format!(
                    "no URL: fault action {:?} targets engine {} but the target lists {} engine admin URL(s); pass --engine-admin or give url",
                    f.action, f.engine, engine_admin.len()
                ));
            }
            Some(url) => match crate::faults::post_json(&client, &url, &body).await {
                Ok(status) => record.status = Some(status),
                Err(e) => record.error = Some(format!("{e:#}")),
            },
        }
        if let Some(e) = &record.error {
            tracing::warn!("fault at {:.1}s failed: {e}", f.at_s);
        }
        records.push(record);
    }
    records
}

async fn show_progress(ctx: Arc<Ctx>, planned: u64, visible: bool, stop: CancellationToken) {
    let bar = if visible {
        indicatif::ProgressBar::new(planned)
    } else {
        indicatif::ProgressBar::hidden()
    };
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let c = &ctx.counters;
        bar.set_length(planned.max(c.scheduled.load(Ordering::Relaxed)));
        bar.set_position(c.done.load(Ordering::Relaxed));
        bar.set_message(format!(
            "sent {} ok {} failed {} in flight {} max lag {:.1} ms",
            c.sent.load(Ordering::Relaxed),
            c.ok.load(Ordering::Relaxed),
            c.failed.load(Ordering::Relaxed),
            c.in_flight.load(Ordering::Relaxed),
            c.max_lag_us.load(Ordering::Relaxed) as f64 / 1000.0,
        ));
    }
    bar.finish_and_clear();
}
