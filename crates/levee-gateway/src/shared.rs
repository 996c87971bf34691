//! Limits shared by a fleet of gateway replicas (`[state] backend = "redis"`).
//!
//! Each tenant's request-rate and token limits and its concurrency (leases), and the global
//! rates, are decided in Redis by levee-store's atomic scripts before the request enters
//! this replica's admission state (which keeps everything else: global concurrency,
//! heavy-request and model limits, lanes, queues). A charge taken in Redis travels with the
//! request and is settled there when it ends: refunded if it was never served, reconciled
//! with the real token usage if it was; its lease is freed either way. Optional local
//! batching hands out slices of a tenant's budget taken from Redis at once; a request-rate
//! refusal from Redis is remembered for the wait it gives.
//!
//! A decision never waits longer than `timeout_ms`. When Redis fails or is slow, this
//! replica switches (one log line, `levee_state_switches_total`) to its `on_failure` mode:
//! `fail_open` decides locally with its share of each limit — the limit divided by the live
//! replicas last counted in Redis — and `fail_closed` answers 503. The heartbeat task probes
//! Redis every `heartbeat_ms` and switches back as soon as it answers.

use crate::clock::TokioClock;
use crate::config::{OnFailure, StateConfig};
use crate::error::{GatewayError, RateInfo};

use crate::metrics::{Metrics, SourceLabel, SwitchLabel};
use crate::upstream::FleetSlice;
use levee_policy::{
    Budget, FleetLedger, Quota, RefusalReason, Scope, SliceDemand, Timestamp, TokenQuota,
};
use levee_store::{
    Decision, Figures, LimitStore, Limited, MemoryStore, RedisStore, ScopeLimits, Settlement,
    SliceDecision,
};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a settlement sent to Redis after the request ended may take.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(1);

/// The scopes a tenant's requests are decided in: global first, the tenant last (its
/// figures go in the response headers).
pub fn scopes(
    cfg: &crate::config::Config,
    tenant: &crate::config::TenantConfig,
) -> Arc<[ScopeLimits]> {
    let rpm = |n: u32, burst: u32| {
        (n > 0).then(|| {
            let q = Quota::per_minute(u64::from(n));
            if burst > 0 {
                q.with_burst(u64::from(burst))
            } else {
                q
            }
        })
    };
    let tpm = |n: u64| (n > 0).then(|| TokenQuota::per_minute(n));
    Arc::from(vec![
        ScopeLimits {
            id: Arc::from("global"),
            requests: rpm(cfg.limits.requests_per_minute, 0),
            tokens: tpm(cfg.limits.tokens_per_minute),
            // The global concurrency bound protects this replica's own queue: it stays local.
            concurrency: None,
        },
        ScopeLimits {
            id: Arc::from(format!("t:{}", tenant.name)),
            requests: rpm(tenant.requests_per_minute, tenant.requests_burst),
            tokens: tpm(tenant.tokens_per_minute),
            concurrency: (tenant.max_concurrency > 0).then_some(u64::from(tenant.max_concurrency)),
        },
    ])
}

/// One replica's share of `scopes` when `live` replicas split them: every rate, burst and
/// capacity divided by `live`, rounded down, at least 1.
fn share(scopes: &[ScopeLimits], live: u32) -> Arc<[ScopeLimits]> {
    let live = u64::from(live.max(1));
    let part = |n: u64| (n / live).max(1);
    scopes
        .iter()
        .map(|s| ScopeLimits {
            id: s.id.clone(),
            requests: s
                .requests
                .map(|q| Quota::new(part(q.count()), q.period()).with_burst(part(q.burst()))),
            tokens: s.tokens.map(|q| {
                TokenQuota::new(part(q.count()), q.period()).with_capacity(part(q.capacity()))
            }),
            concurrency: s.concurrency.map(part),
        })
        .collect()
}

/// The rest of a slice of one tenant's budget, charged in Redis, handed out here.
#[derive(Debug)]
struct LocalSlice {
    scopes: Arc<[ScopeLimits]>,
    requests: u64,
    tokens: u64,
    taken_at: tokio::time::Instant,
    figures: Figures,
}

/// Where a charge was taken, and so where it is settled.
#[derive(Debug)]
enum Source {
    Redis,
    /// This replica's fallback store, with the shares it was decided under.
    Local(Arc<[ScopeLimits]>),
}

/// The shared limit state of this replica.
pub struct Shared {
    store: RedisStore,
    local: MemoryStore<TokioClock>,
    timeout: Duration,
    mode: OnFailure,
    heartbeat: Duration,
    /// How often the backend slices are renewed (at most `heartbeat`).
    slice_renew: Duration,
    replica: String,
    url: String,
    prefix: String,
    /// Decisions go to Redis (true) or to the local fallback.
    shared: AtomicBool,
    /// Live replicas at the last heartbeat (1 until one succeeds).
    live: AtomicU32,
    last_error: Mutex<Option<String>>,
    /// Leases held in Redis by this replica's requests, renewed at each heartbeat: lease
    /// id → the scopes it is held in.
    leases: Mutex<HashMap<String, Vec<Arc<str>>>>,
    next_lease: AtomicU64,
    /// Requests per slice (≤ 1: no batching).
    batch: u64,
    /// Each tenant's current slice, by its scope id.
    slices: Mutex<HashMap<Arc<str>, LocalSlice>>,
    /// Each tenant's fleet-wide figures as of this replica's last decision for it.
    figures: Mutex<HashMap<Arc<str>, Figures>>,
    /// Scopes Redis refused by request rate, until the wait it gave: while it lasts, this
    /// replica refuses their requests itself instead of asking again (a flooding tenant
    /// costs Redis one call per wait, not one per request).
    refused_until: Mutex<HashMap<Arc<str>, tokio::time::Instant>>,
    gauge: Gauge,
    replicas_gauge: Gauge,
    switches: Family<SwitchLabel, Counter>,
    decisions: Family<SourceLabel, Counter>,
    /// This replica's slices of the backends' budgets (see [`Shared::renew_slice`]).
    ledger: Mutex<FleetLedger>,
    /// Set by [`Shared::leave`]: no slice is leased and no demand published after it.
    left: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("replica", &self.replica)
            .field("shared", &self.shared.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A default replica name unique in this process: host name, process id, a counter.
fn replica_name() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "levee".to_string());
    format!(
        "{host}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// `url` without a password, for logs and the admin state.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

impl Shared {
    /// Connects lazily to the configured Redis (a server that is down at start only means
    /// this replica starts on its fallback).
    pub fn new(cfg: &StateConfig, clock: TokioClock, metrics: &Metrics) -> anyhow::Result<Self> {
        let timeout = Duration::from_millis(cfg.timeout_ms.max(1));
        let heartbeat = Duration::from_millis(cfg.heartbeat_ms.max(50));
        // A lease outlives two missed heartbeats, and no more: a dead replica's leases free
        // themselves within three heartbeat intervals.
        let store = RedisStore::new(&cfg.url, &cfg.key_prefix, timeout)
            .map_err(|e| anyhow::anyhow!("state.url: {e}"))?
            .with_lease_ttl(heartbeat * 3);
        let replica = if cfg.replica_id.is_empty() {
            replica_name()
        } else {
            cfg.replica_id.clone()
        };
        metrics.state_shared.set(1);
        metrics.fleet_replicas.set(1);
        Ok(Shared {
            store,
            local: MemoryStore::new(clock),
            timeout,
            mode: cfg.on_failure,
            heartbeat,
            slice_renew: Duration::from_millis(cfg.slice_renew_ms.max(10)).min(heartbeat),
            replica,
            url: redacted(&cfg.url),
            prefix: cfg.key_prefix.clone(),
            shared: AtomicBool::new(true),
            live: AtomicU32::new(1),
            last_error: Mutex::new(None),
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(0),
            batch: u64::from(cfg.batch),
            slices: Mutex::new(HashMap::new()),
            figures: Mutex::new(HashMap::new()),
            refused_until: Mutex::new(HashMap::new()),
            gauge: metrics.state_shared.clone(),
            replicas_gauge: metrics.fleet_replicas.clone(),
            switches: metrics.state_switches.clone(),
            decisions: metrics.state_decisions.clone(),
            ledger: Mutex::new(FleetLedger::new(heartbeat * 3)),
            left: AtomicBool::new(false),
        })
    }

    /// This replica's name among its peers.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The server's URL, password hidden.
    pub fn redacted_url(&self) -> &str {
        &self.url
    }

    /// Whether decisions go to Redis now.
    pub fn is_shared(&self) -> bool {
        self.shared.load(Ordering::Acquire)
    }

    /// Live replicas at the last heartbeat.
    pub fn live_replicas(&self) -> u32 {
        self.live.load(Ordering::Relaxed).max(1)
    }

    fn count(&self, source: &str) {
        self.decisions
            .get_or_create(&SourceLabel {
                source: source.into(),
            })
            .inc();
    }

    /// Redis failed: switch to the fallback (once; later failures only update the error).
    fn went_down(&self, why: String) {
        if self.shared.swap(false, Ordering::AcqRel) {
            let to = match self.mode {
                OnFailure::FailOpen => "local",
                OnFailure::FailClosed => "closed",
            };
            self.gauge.set(0);
            self.switches
                .get_or_create(&SwitchLabel { to: to.into() })
                .inc();
            match self.mode {
                OnFailure::FailOpen => tracing::warn!(
                    replica = %self.replica,
                    "shared limit store {} unavailable ({why}); deciding limits locally with \
                     1/{} of each (fail_open) until it answers",
                    self.url,
                    self.live_replicas()
                ),
                OnFailure::FailClosed => tracing::warn!(
                    replica = %self.replica,
                    "shared limit store {} unavailable ({why}); refusing requests with 503 \
                     (fail_closed) until it answers",
                    self.url
                ),
            }
        }
        *self.last_error.lock() = Some(why);
    }

    fn came_back(&self) {
        if !self.shared.swap(true, Ordering::AcqRel) {
            self.gauge.set(1);
            self.switches
                .get_or_create(&SwitchLabel {
                    to: "shared".into(),
                })
                .inc();
            tracing::info!(
                replica = %self.replica,
                "shared limit store {} answers again; limits are fleet-wide again",
                self.url
            );
        }
    }

    /// One heartbeat: reports this replica alive, learns the live count, switches back to
    /// Redis when it answers.
    pub async fn beat(&self) {
        match tokio::time::timeout(
            self.timeout,
            self.store.heartbeat(&self.replica, self.heartbeat * 3),
        )
        .await
        {
            Ok(Ok(n)) => {
                self.live.store(n.max(1), Ordering::Relaxed);
                self.replicas_gauge.set(i64::from(n.max(1)));
                self.came_back();
                let held: Vec<(Arc<str>, String)> = self
                    .leases
                    .lock()
                    .iter()
                    .flat_map(|(id, scopes)| scopes.iter().map(|s| (s.clone(), id.clone())))
                    .collect();
                if let Ok(Err(e)) =
                    tokio::time::timeout(self.timeout, self.store.renew(&held)).await
                {
                    tracing::debug!(replica = %self.replica, "lease renewal failed: {e}");
                }
                // Slices older than a heartbeat give their unused rest back, so budget never
                // sits here long while other replicas need it.
                let now = tokio::time::Instant::now();
                let old: Vec<LocalSlice> = {
                    let mut slices = self.slices.lock();
                    let keys: Vec<Arc<str>> = slices
                        .iter()
                        .filter(|(_, s)| now.duration_since(s.taken_at) >= self.heartbeat)
                        .map(|(k, _)| k.clone())
                        .collect();
                    keys.iter().filter_map(|k| slices.remove(k)).collect()
                };
                for s in old {
                    self.give_back(s);
                }
            }
            Ok(Err(e)) => self.went_down(e.to_string()),
            Err(_) => self.went_down(format!(
                "heartbeat unanswered within {} ms",
                self.timeout.as_millis()
            )),
        }
    }

    /// How often [`Shared::beat`] runs.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat
    }

    /// How often [`Shared::renew_slice`] runs for every backend.
    pub fn slice_renew_interval(&self) -> Duration {
        self.slice_renew
    }

    /// Renews this replica's slice of backend `key`'s `budget` for what it has there and
    /// waiting (`demand`), waiting at most the decision timeout; when Redis does not answer
    /// in time it keeps its current slice. Returns the slice to admit against now.
    ///
    /// `admitting` is what the replica admits against until the answer arrives (its current
    /// limits there): the shared state records as held at least the larger of that and what
    /// is in flight, since requests admitted during the round trip are not in `demand`. A
    /// shrinking slice thus frees its room for the others one renewal later, never before
    /// the replica stops admitting into it.
    pub async fn renew_slice(
        &self,
        key: &Arc<str>,
        budget: Budget,
        demand: &[SliceDemand],
        admitting: Budget,
        now: Timestamp,
    ) -> FleetSlice {
        let want = levee_policy::slice_want(budget, demand);
        let may_run = Budget {
            slots: demand
                .iter()
                .map(|d| d.in_flight)
                .sum::<u64>()
                .max(admitting.slots),
            kv_tokens: demand
                .iter()
                .map(|d| d.kv_in_flight)
                .sum::<u64>()
                .max(admitting.kv_tokens),
        };
        let lease = self.ledger.lock().lease();
        if self.left.load(Ordering::Acquire) {
            return self.slice_now(key, budget, now);
        }
        let asked = self
            .store
            .lease_backend(key, &self.replica, lease, budget, &want, may_run);
        match tokio::time::timeout(self.timeout, asked).await {
            Ok(Ok(grant)) => self.ledger.lock().granted(key, grant, now),
            Ok(Err(e)) => {
                tracing::debug!(replica = %self.replica, backend = %key, "slice renewal failed: {e}")
            }
            Err(_) => {
                tracing::debug!(replica = %self.replica, backend = %key, "slice renewal timed out")
            }
        }
        self.slice_now(key, budget, now)
    }

    /// The slice of backend `key`'s `budget` to admit against now: the last grant, or before
    /// one an equal part over the replicas last counted.
    pub fn slice_now(&self, key: &str, budget: Budget, now: Timestamp) -> FleetSlice {
        let ledger = self.ledger.lock();
        let grant = ledger.grant(key);
        FleetSlice {
            allowed: ledger.allowance(key, budget, self.live_replicas()),
            others: grant.map(|g| g.others).unwrap_or_default(),
            replicas: grant.map_or(self.live_replicas(), |g| g.replicas),
            budget,
            granted: grant.is_some(),
            lapsed: ledger.lapsed(key, now),
        }
    }

    /// Publishes this replica's demand for `model` (arrivals per second, queued) and returns
    /// the other live replicas' (and how many replicas published, this one included);
    /// `None` when Redis did not answer within the decision timeout.
    pub async fn fleet_demand(
        &self,
        model: &str,
        rate: f64,
        queued: u64,
    ) -> Option<(f64, u64, u32)> {
        if self.left.load(Ordering::Acquire) {
            return None;
        }
        let lifetime = self.heartbeat * 3;
        let asked = self
            .store
            .fleet_demand(model, &self.replica, lifetime, rate, queued);
        match tokio::time::timeout(self.timeout, asked).await {
            Ok(Ok(d)) => Some(d),
            _ => None,
        }
    }

    /// Forgets slices of backends no longer configured (their leases lapse in Redis).
    pub fn retain_slices(&self, keep: &[Arc<str>]) {
        self.ledger.lock().retain(keep);
    }

    /// Leaves the live set at once, returns this replica's backend slices and gives unused
    /// limit slices back (clean shutdown), each within the decision timeout.
    pub async fn leave(&self) {
        self.left.store(true, Ordering::Release);
        let _ = tokio::time::timeout(self.timeout, self.store.leave(&self.replica)).await;
        let (held, lease) = {
            let l = self.ledger.lock();
            (l.backends(), l.lease())
        };
        for key in held {
            let none = Budget::default();
            let give_back = self
                .store
                .lease_backend(&key, &self.replica, lease, none, &[], none);
            let _ = tokio::time::timeout(self.timeout, give_back).await;
        }
        let slices: Vec<LocalSlice> = self.slices.lock().drain().map(|(_, s)| s).collect();
        for s in slices {
            let unused = Settlement::unused(s.requests, s.tokens);
            let _ =
                tokio::time::timeout(self.timeout, self.store.settle(&s.scopes, unused, "")).await;
        }
    }

    /// Decides a request of `tokens` in `scopes`. `Ok(None)`: nothing to charge.
    pub async fn take(
        self: &Arc<Self>,
        scopes: &Arc<[ScopeLimits]>,
        tokens: u64,
    ) -> Result<Option<Charge>, GatewayError> {
        if !scopes.iter().any(ScopeLimits::is_limited) {
            return Ok(None);
        }
        let lease = if scopes.iter().any(|s| s.concurrency.is_some()) {
            let n = self.next_lease.fetch_add(1, Ordering::Relaxed);
            format!("{}:{n}", self.replica)
        } else {
            String::new()
        };
        let batched = self.batch > 1 && lease.is_empty() && self.is_shared();
        // A slice already charged in Redis is spent before a remembered refusal is
        // repeated: its requests are paid for.
        if batched {
            if let Some(charge) = self.from_slice(scopes, tokens) {
                return Ok(Some(charge));
            }
        }
        if self.is_shared() {
            if let Some(refused) = self.still_refused(scopes, tokens) {
                self.count("cache");
                return Err(refused);
            }
        }
        if batched {
            if let Some(r) = self.take_batched(scopes, tokens).await {
                return r;
            }
        }
        if self.is_shared() {
            let took = self.store.take(scopes, tokens, &lease);
            match tokio::time::timeout(self.timeout, took).await {
                Ok(Ok(d)) => {
                    self.count("redis");
                    if matches!(d, Decision::Admitted(_)) && !lease.is_empty() {
                        let held = scopes
                            .iter()
                            .filter(|s| s.concurrency.is_some())
                            .map(|s| s.id.clone())
                            .collect();
                        self.leases.lock().insert(lease.clone(), held);
                    }
                    return self.decided(d, scopes, Source::Redis, tokens, lease);
                }
                Ok(Err(e)) => self.went_down(e.to_string()),
                Err(_) => {
                    self.went_down(format!("no answer within {} ms", self.timeout.as_millis()))
                }
            }
        }
        match self.mode {
            OnFailure::FailClosed => Err(GatewayError::shared_state_unavailable(
                &format!("Redis at {}", self.url),
                self.heartbeat,
            )),
            OnFailure::FailOpen => {
                let local = share(scopes, self.live_replicas());
                let d = self.local.take_now(&local, tokens, &lease);
                self.count("local");
                self.decided(d, scopes, Source::Local(local), tokens, lease)
            }
        }
    }

    /// A refusal Redis gave for a scope's request rate that still holds (see
    /// `refused_until`), as this request's answer.
    fn still_refused(&self, scopes: &[ScopeLimits], tokens: u64) -> Option<GatewayError> {
        let now = tokio::time::Instant::now();
        let mut until = self.refused_until.lock();
        for (i, s) in scopes.iter().enumerate() {
            let Some(&t) = until.get(&s.id) else { continue };
            if t > now {
                return Some(refusal(
                    scopes,
                    i,
                    Limited::Requests,
                    t - now,
                    tokens,
                    false,
                ));
            }
            until.remove(&s.id);
        }
        None
    }

    /// Remembers a request-rate refusal of scope `i` for the wait Redis gave.
    fn remember_refusal(&self, scopes: &[ScopeLimits], i: usize, limit: Limited, wait: Duration) {
        if let (Limited::Requests, Some(s)) = (limit, scopes.get(i)) {
            let until = tokio::time::Instant::now() + wait;
            self.refused_until.lock().insert(s.id.clone(), until);
        }
    }

    /// The unused rest of a slice goes back to Redis (in the background: off every
    /// request's path).
    fn give_back(&self, s: LocalSlice) {
        if s.requests == 0 && s.tokens == 0 {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        rt.spawn(async move {
            let unused = Settlement::unused(s.requests, s.tokens);
            let _ = tokio::time::timeout(SETTLE_TIMEOUT, store.settle(&s.scopes, unused, "")).await;
        });
    }

    /// A charge against one request of the tenant's slice on this replica, when the slice
    /// holds one (and its tokens, where tokens are limited).
    fn from_slice(self: &Arc<Self>, scopes: &Arc<[ScopeLimits]>, tokens: u64) -> Option<Charge> {
        let key = scopes.last()?.id.clone();
        let token_limited = scopes.iter().any(|s| s.tokens.is_some());
        let mut slices = self.slices.lock();
        let s = slices.get_mut(&key)?;
        if s.requests == 0 || (token_limited && s.tokens < tokens) {
            return None;
        }
        s.requests -= 1;
        s.tokens = s.tokens.saturating_sub(tokens);
        let figures = s.figures;
        drop(slices);
        self.count("slice");
        Some(self.batched_charge(scopes, tokens, figures))
    }

    fn batched_charge(
        self: &Arc<Self>,
        scopes: &Arc<[ScopeLimits]>,
        tokens: u64,
        figures: Figures,
    ) -> Charge {
        Charge {
            shared: self.clone(),
            scopes: scopes.clone(),
            tokens,
            lease: String::new(),
            source: Some(Source::Redis),
            figures,
        }
    }

    /// Takes a new slice of the tenant's budget from Redis (the request that found this
    /// replica's slice spent). `None`: Redis failed (the caller falls back).
    async fn take_batched(
        self: &Arc<Self>,
        scopes: &Arc<[ScopeLimits]>,
        tokens: u64,
    ) -> Option<Result<Option<Charge>, GatewayError>> {
        let key = scopes.last()?.id.clone();
        let want_tokens = tokens.saturating_mul(self.batch);
        let took = self
            .store
            .take_slice(scopes, self.batch, want_tokens, tokens);
        match tokio::time::timeout(self.timeout, took).await {
            Ok(Ok(SliceDecision::Granted(g))) => {
                self.count("redis");
                self.figures.lock().insert(key.clone(), g.figures);
                let mut rest = LocalSlice {
                    scopes: scopes.clone(),
                    requests: g.requests.saturating_sub(1),
                    tokens: g.tokens.saturating_sub(tokens),
                    taken_at: tokio::time::Instant::now(),
                    figures: g.figures,
                };
                let mut slices = self.slices.lock();
                let old = slices.remove(&key);
                // Requests that found the slice spent at once each took one: the rests
                // join (charged already; given back as one, by the older's age).
                let old = match old {
                    Some(o) if o.scopes == rest.scopes => {
                        rest.requests = rest.requests.saturating_add(o.requests);
                        rest.tokens = rest.tokens.saturating_add(o.tokens);
                        rest.taken_at = o.taken_at;
                        None
                    }
                    other => other,
                };
                slices.insert(key, rest);
                drop(slices);
                if let Some(old) = old {
                    self.give_back(old);
                }
                Some(Ok(Some(self.batched_charge(scopes, tokens, g.figures))))
            }
            Ok(Ok(SliceDecision::Refused {
                scope,
                limit,
                retry_after,
            })) => {
                self.count("redis");
                self.remember_refusal(scopes, scope, limit, retry_after);
                Some(Err(refusal(
                    scopes,
                    scope,
                    limit,
                    retry_after,
                    tokens,
                    false,
                )))
            }
            Ok(Err(e)) => {
                self.went_down(e.to_string());
                None
            }
            Err(_) => {
                self.went_down(format!("no answer within {} ms", self.timeout.as_millis()));
                None
            }
        }
    }

    fn decided(
        self: &Arc<Self>,
        d: Decision,
        scopes: &Arc<[ScopeLimits]>,
        source: Source,
        tokens: u64,
        lease: String,
    ) -> Result<Option<Charge>, GatewayError> {
        match d {
            Decision::Admitted(figures) => {
                if let (Source::Redis, Some(last)) = (&source, scopes.last()) {
                    self.figures.lock().insert(last.id.clone(), figures);
                }
                Ok(Some(Charge {
                    shared: self.clone(),
                    scopes: scopes.clone(),
                    tokens,
                    lease,
                    source: Some(source),
                    figures,
                }))
            }
            Decision::Refused {
                scope,
                limit,
                retry_after,
            } => {
                let local = matches!(source, Source::Local(_));
                if !local {
                    self.remember_refusal(scopes, scope, limit, retry_after);
                }
                Err(refusal(scopes, scope, limit, retry_after, tokens, local))
            }
        }
    }

    /// A tenant's fleet-wide figures (its scopes, tenant last) for `/admin/state`: as of
    /// this replica's last decision for it in Redis, or a full budget if it made none.
    pub fn tenant_figures(
        &self,
        scopes: &[ScopeLimits],
        now: levee_policy::Timestamp,
    ) -> levee_policy::RateLimitHeaders {
        let Some(tenant) = scopes.last() else {
            return levee_policy::RateLimitHeaders::default();
        };
        let seen = self
            .figures
            .lock()
            .get(&tenant.id)
            .copied()
            .unwrap_or_default();
        levee_policy::RateLimitHeaders {
            requests: seen.requests.or_else(|| {
                tenant
                    .requests
                    .map(|q| levee_policy::Gcra::new(q).info(now))
            }),
            tokens: seen.tokens.or_else(|| {
                tenant
                    .tokens
                    .map(|q| levee_policy::TokenBucket::new(q).info(now))
            }),
            concurrency: None,
        }
    }

    /// The `state` section of `/admin/state`.
    pub fn state_json(&self) -> serde_json::Value {
        serde_json::json!({
            "backend": "redis",
            "url": self.url,
            "key_prefix": self.prefix,
            "replica": self.replica,
            "healthy": self.is_shared(),
            "mode": if self.is_shared() { "shared" } else {
                match self.mode { OnFailure::FailOpen => "fail_open", OnFailure::FailClosed => "fail_closed" }
            },
            "on_failure": match self.mode { OnFailure::FailOpen => "fail_open", OnFailure::FailClosed => "fail_closed" },
            "live_replicas": self.live_replicas(),
            "timeout_ms": u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            "batch": self.batch,
            "last_error": *self.last_error.lock(),
        })
    }
}

fn refusal(
    scopes: &[ScopeLimits],
    scope: usize,
    limit: Limited,
    retry_after: Duration,
    tokens: u64,
    local: bool,
) -> GatewayError {
    let (name, s) = match scopes.get(scope).map(|s| &*s.id) {
        Some(id) if id.starts_with("t:") => (format!("tenant {}", &id[2..]), Scope::Tenant),
        _ => ("global".to_string(), Scope::Global),
    };
    let fleet = if local {
        "this replica's share of the fleet's"
    } else {
        "the fleet's"
    };
    let retry = retry_after.max(Duration::from_millis(1));
    let tokens_rate = format!("{fleet} {name} tokens per minute ({tokens} tokens estimated)");
    let (what, retry, rate, reason) = match limit {
        // A lease frees when one of the tenant's requests ends, which the store cannot time.
        Limited::Concurrency => (
            format!("{fleet} {name}: requests in flight at its limit"),
            Duration::from_secs(1),
            RateInfo::default(),
            RefusalReason::Concurrency(s),
        ),
        Limited::Requests => (
            format!("{fleet} {name} requests per minute"),
            retry,
            RateInfo {
                remaining_requests: Some(0),
                ..Default::default()
            },
            RefusalReason::RequestRate(s),
        ),
        // A share smaller than the request refuses it for now, not for ever.
        Limited::TooLarge { .. } if local => (
            tokens_rate,
            Duration::from_secs(1),
            RateInfo::default(),
            RefusalReason::TokenRate(s),
        ),
        Limited::Tokens => (
            tokens_rate,
            retry,
            RateInfo {
                remaining_tokens: Some(0),
                ..Default::default()
            },
            RefusalReason::TokenRate(s),
        ),
        Limited::TooLarge { capacity } => {
            return GatewayError::bad_request(format!(
                "this request needs about {tokens} tokens but the {name} token quota holds \
                 {capacity}; lower max_tokens or shorten the prompt"
            ))
            .with_param("max_tokens")
            .with_refusal(RefusalReason::TooLarge(s))
        }
    };
    GatewayError::rate_limited(&what, retry, rate).with_refusal(reason)
}

/// A charge taken in the shared (or fallback) store for one request. Dropped unsettled, it
/// is refunded: the request was never served.
#[must_use = "settle the charge with reconcile or keep; dropping it refunds it"]
pub struct Charge {
    shared: Arc<Shared>,
    scopes: Arc<[ScopeLimits]>,
    tokens: u64,
    /// Its concurrency lease (empty: none).
    lease: String,
    source: Option<Source>,
    /// The tenant's figures after this charge, for the `x-ratelimit-*` headers.
    pub figures: Figures,
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charge")
            .field("tokens", &self.tokens)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Charge {
    /// The request was served and used `actual` tokens; its lease frees.
    pub fn reconcile(mut self, actual: u64) {
        if actual != self.tokens || !self.lease.is_empty() {
            self.settle(Settlement::reconcile(self.tokens, actual));
        }
        self.source = None;
    }

    /// The request went upstream but its usage is unknown: the estimate stays charged; its
    /// lease frees.
    pub fn keep(mut self) {
        if !self.lease.is_empty() {
            self.settle(Settlement::reconcile(self.tokens, self.tokens));
        }
        self.source = None;
    }

    fn settle(&mut self, s: Settlement) {
        let lease = std::mem::take(&mut self.lease);
        match self.source.take() {
            None => {}
            Some(Source::Local(local)) => self.shared.local.settle_now(&local, s, &lease),
            Some(Source::Redis) => {
                if !lease.is_empty() {
                    self.shared.leases.lock().remove(&lease);
                }
                let Ok(rt) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                let shared = self.shared.clone();
                let scopes = self.scopes.clone();
                rt.spawn(async move {
                    let settled = shared.store.settle(&scopes, s, &lease);
                    let r = tokio::time::timeout(SETTLE_TIMEOUT, settled).await;
                    if !matches!(r, Ok(Ok(()))) {
                        // Lost: a refund not given back or a charge not taken; the bucket
                        // refills either way.
                        tracing::debug!(replica = %shared.replica, "shared limit settlement lost");
                    }
                });
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let tokens = self.tokens;
        self.settle(Settlement::refund(tokens));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_divides_every_limit_and_keeps_at_least_one() {
        let scopes = [ScopeLimits {
            id: Arc::from("t:x"),
            requests: Some(Quota::per_minute(60).with_burst(10)),
            tokens: Some(TokenQuota::per_minute(9_000).with_capacity(3_000)),
            concurrency: Some(2),
        }];
        let s = share(&scopes, 3);
        let r = s[0].requests.unwrap();
        assert_eq!(
            (r.count(), r.burst(), r.period()),
            (20, 3, Duration::from_secs(60))
        );
        let t = s[0].tokens.unwrap();
        assert_eq!((t.count(), t.capacity()), (3_000, 1_000));
        assert_eq!(s[0].concurrency, Some(1));
        // Alone (or never having counted its peers), a replica holds the whole limit.
        assert_eq!(share(&scopes, 1)[..], scopes[..]);
        assert_eq!(share(&scopes, 0)[..], scopes[..]);
    }
}
