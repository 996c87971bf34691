//! The Redis store: the limiters' arithmetic as atomic Lua scripts.
//!
//! Each decision is one `EVALSHA` (the `redis` crate loads a script on `NOSCRIPT`, e.g.
//! after a server restart). State per scope is one hash whose fields are theoretical
//! arrival times in microseconds of the server's `TIME`, so replicas' clocks never matter.
//! Keys are `<prefix>lim:v<SCRIPT_VERSION>:{<scope>}` (rates) and
//! `<prefix>lease:v<SCRIPT_VERSION>:{<scope>}` (concurrency leases, a sorted set scored by
//! expiry): the version keeps replicas running different scripts (a rolling upgrade) on
//! separate state, and the braces are a Redis Cluster hash tag (each scope's state sits in
//! one slot). Rate keys expire once their bucket has refilled, so idle tenants cost nothing;
//! a lease expires unless its replica renews it ([`RedisStore::renew`]), so the leases of a
//! replica that died free themselves.

use crate::limits::{
    Decision, Figures, LimitStore, Limited, ScopeLimits, Settlement, Slice, SliceDecision,
    StoreError,
};
use levee_policy::{Budget, Clock, RateLimitInfo, SliceGrant};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use std::sync::Arc;
use std::time::Duration;

/// The version of the Lua scripts, part of every key name.
pub const SCRIPT_VERSION: u32 = 2;

const TAKE: &str = include_str!("scripts/take.lua");
const SETTLE: &str = include_str!("scripts/settle.lua");
const HEARTBEAT: &str = include_str!("scripts/heartbeat.lua");
const RENEW: &str = include_str!("scripts/renew.lua");
const SLICE: &str = include_str!("scripts/slice.lua");
const FLEET: &str = include_str!("scripts/fleet.lua");
const DEMAND: &str = include_str!("scripts/demand.lua");

/// The version of the backend-budget lease script, part of its keys' names.
pub const FLEET_VERSION: u32 = 2;

/// The version of the fleet demand script, part of its keys' names.
const DEMAND_VERSION: u32 = 1;

/// Limits shared through one Redis (or Valkey) server.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    lease_ttl: Duration,
    /// Decide on this clock instead of the server's `TIME` (see [`RedisStore::with_clock`]).
    clock: Option<Arc<dyn Clock>>,
    take: Script,
    settle: Script,
    heartbeat: Script,
    renew: Script,
    slice: Script,
    fleet: Script,
    demand: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Six script arguments per scope: request interval and tolerance, token interval and
/// tolerance (µs), token capacity, leases allowed. Zero: not limited.
fn scope_args(s: &ScopeLimits, args: &mut Vec<String>) {
    match s.requests {
        Some(q) => {
            let interval = q.period().as_secs_f64() * 1e6 / q.count() as f64;
            args.push(interval.to_string());
            args.push((interval * q.burst() as f64).to_string());
        }
        None => {
            args.push("0".into());
            args.push("0".into());
        }
    }
    match s.tokens {
        Some(q) => {
            let interval = q.period().as_secs_f64() * 1e6 / q.count() as f64;
            args.push(interval.to_string());
            args.push((interval * q.capacity() as f64).to_string());
            args.push(q.capacity().to_string());
        }
        None => {
            args.push("0".into());
            args.push("0".into());
            args.push("0".into());
        }
    }
    args.push(s.concurrency.unwrap_or(0).to_string());
}

fn micros(us: i64) -> Duration {
    Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

/// The figures of an admitting reply `[remaining requests, their reset µs, remaining tokens,
/// their reset µs]`: the script reports the last limited scope's, which are the last scope's
/// figures when that scope is limited (none otherwise).
fn last_figures(scopes: &[ScopeLimits], last: &ScopeLimits, reply: [i64; 4]) -> Figures {
    let [rr, rreset, tr, treset] = reply;
    if scopes
        .last()
        .is_some_and(|s| s.requests.is_some() || s.tokens.is_some())
    {
        Figures {
            requests: info(last.requests.map(|q| q.burst()), rr, rreset),
            tokens: info(last.tokens.map(|q| q.capacity()), tr, treset),
        }
    } else {
        Figures::default()
    }
}

/// A refusing reply's scope (the `i`-th limited one, from 1) and what refused there (`kind`: 1
/// request rate, 2 token rate, 3 larger than the token bucket, 4 concurrency).
fn refusal(
    reply: &[i64],
    limited: &[(usize, &ScopeLimits)],
    i: i64,
    kind: i64,
) -> Result<(usize, Limited), StoreError> {
    let bad = || StoreError::Reply(reply.to_vec());
    let &(scope, limits) = usize::try_from(i - 1)
        .ok()
        .and_then(|i| limited.get(i))
        .ok_or_else(bad)?;
    let limit = match kind {
        1 => Limited::Requests,
        2 => Limited::Tokens,
        3 => Limited::TooLarge {
            capacity: limits.tokens.map_or(0, |q| q.capacity()),
        },
        4 => Limited::Concurrency,
        _ => return Err(bad()),
    };
    Ok((scope, limit))
}

fn info(limit: Option<u64>, remaining: i64, reset_us: i64) -> Option<RateLimitInfo> {
    let limit = limit?;
    (remaining >= 0).then(|| RateLimitInfo {
        limit,
        remaining: u64::try_from(remaining).unwrap_or(0).min(limit),
        reset_after: micros(reset_us),
    })
}

impl RedisStore {
    /// A store on the server at `url` (`redis://host:port[/db]`), keys under `prefix`. No
    /// connection is made here: the first command connects, and a lost connection is
    /// re-established on a later command. `timeout` bounds each command and each connection
    /// attempt. Leases live 30 s unless renewed (see [`RedisStore::with_lease_ttl`]).
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)?;
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(100));
        let conn = ConnectionManager::new_lazy_with_config(client, cfg)?;
        Ok(RedisStore {
            conn,
            prefix: prefix.to_string(),
            lease_ttl: Duration::from_secs(30),
            clock: None,
            take: Script::new(TAKE),
            settle: Script::new(SETTLE),
            heartbeat: Script::new(HEARTBEAT),
            renew: Script::new(RENEW),
            slice: Script::new(SLICE),
            fleet: Script::new(FLEET),
            demand: Script::new(DEMAND),
        })
    }

    /// How long a lease lives after it was taken or last renewed. A replica renews its
    /// leases more often than this; one that dies stops, and its leases free themselves
    /// within this time.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl.max(Duration::from_millis(1));
        self
    }

    /// Decides and settles at the time of `clock` (whole microseconds of its nanoseconds)
    /// instead of the server's `TIME`: for tests that run these scripts and an in-memory
    /// store on one manual clock. A fleet never does this: its replicas share the server's
    /// clock exactly because their own clocks differ.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The scripts' optional last argument: the time to decide at (µs), if a clock is set.
    fn push_now(&self, args: &mut Vec<String>) {
        if let Some(c) = &self.clock {
            args.push((c.now().as_nanos() / 1000).to_string());
        }
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// The keys of a scope's state: its rates, its leases.
    fn keys(&self, scope: &str) -> [String; 2] {
        let v = SCRIPT_VERSION;
        [
            format!("{}lim:v{v}:{{{scope}}}", self.prefix),
            format!("{}lease:v{v}:{{{scope}}}", self.prefix),
        ]
    }

    /// Extends the lifetime of leases still held: `(scope id, lease id)` pairs.
    pub async fn renew(&self, leases: &[(std::sync::Arc<str>, String)]) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        let mut inv = self.renew.prepare_invoke();
        inv.arg(self.ttl_ms());
        for (scope, id) in leases {
            let [_, lease_key] = self.keys(scope);
            inv.key(lease_key);
            inv.arg(id);
        }
        let mut conn = self.conn.clone();
        let _: i64 = inv.invoke_async(&mut conn).await?;
        Ok(())
    }

    /// The hash of backend `backend`'s slices.
    fn fleet_key(&self, backend: &str) -> String {
        format!("{}fleet:v{FLEET_VERSION}:{{{backend}}}", self.prefix)
    }

    /// Leases, renews or (with `want` and `in_flight` both zero) returns replica
    /// `replica`'s slice of `backend`'s `budget` for `lease` (see levee-policy's `fleet`
    /// module for the rule, `scripts/fleet.lua` for the script). `want` is what it asks for
    /// per priority class, the highest first (levee-policy's `slice_want`); `in_flight` is
    /// what the replica may run there until this answer reaches it (what it has in flight,
    /// or the slice it admits against meanwhile, whichever is larger): it stays counted as
    /// held even when the slice shrinks below it.
    pub async fn lease_backend(
        &self,
        backend: &str,
        replica: &str,
        lease: Duration,
        budget: Budget,
        want: &[Budget],
        in_flight: Budget,
    ) -> Result<SliceGrant, StoreError> {
        let ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut conn = self.conn.clone();
        let mut call = self.fleet.key(self.fleet_key(backend));
        call.arg(replica)
            .arg(ms)
            .arg(budget.slots)
            .arg(budget.kv_tokens)
            .arg(in_flight.slots)
            .arg(in_flight.kv_tokens);
        for w in want {
            call.arg(w.slots.min(budget.slots))
                .arg(w.kv_tokens.min(budget.kv_tokens));
        }
        let reply: Vec<i64> = call.invoke_async(&mut conn).await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        match reply.as_slice() {
            [s, k, os, ok, r] => Ok(SliceGrant {
                allowed: Budget {
                    slots: n(*s),
                    kv_tokens: n(*k),
                },
                others: Budget {
                    slots: n(*os),
                    kv_tokens: n(*ok),
                },
                replicas: u32::try_from(*r).unwrap_or(1),
            }),
            _ => Err(StoreError::Reply(reply)),
        }
    }

    /// Publishes replica `replica`'s demand for `model` — its arrivals per second and its
    /// requests queued — for `lifetime`, and returns the other live replicas' sum:
    /// arrivals per second, queued, and the replicas publishing (this one included).
    pub async fn fleet_demand(
        &self,
        model: &str,
        replica: &str,
        lifetime: Duration,
        rate: f64,
        queued: u64,
    ) -> Result<(f64, u64, u32), StoreError> {
        let ms = u64::try_from(lifetime.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let key = format!("{}demand:v{DEMAND_VERSION}:{{{model}}}", self.prefix);
        let rate = if rate.is_finite() { rate.max(0.0) } else { 0.0 };
        let mut conn = self.conn.clone();
        let (others, queued, n): (String, u64, u32) = self
            .demand
            .key(key)
            .arg(replica)
            .arg(ms)
            .arg(format!("{rate:.6}"))
            .arg(queued)
            .invoke_async(&mut conn)
            .await?;
        let others: f64 = others
            .parse()
            .map_err(|_| StoreError::Reply(vec![queued as i64, i64::from(n)]))?;
        Ok((others, queued, n))
    }

    /// Records that replica `id` is alive and returns how many replicas are (those whose
    /// last heartbeat is younger than `window`, this one included).
    pub async fn heartbeat(&self, id: &str, window: Duration) -> Result<u32, StoreError> {
        let key = format!("{}replicas:v{SCRIPT_VERSION}", self.prefix);
        let ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut conn = self.conn.clone();
        let n: u32 = self
            .heartbeat
            .key(key)
            .arg(id)
            .arg(ms)
            .invoke_async(&mut conn)
            .await?;
        Ok(n)
    }

    /// Removes replica `id` from the live set at once (a clean shutdown), so its peers'
    /// shares grow without waiting for its heartbeat to age out.
    pub async fn leave(&self, id: &str) -> Result<(), StoreError> {
        let key = format!("{}replicas:v{SCRIPT_VERSION}", self.prefix);
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("ZREM")
            .arg(key)
            .arg(id)
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// Deletes every key under this store's prefix (tests and benchmarks clean up with it).
    pub async fn clear(&self) -> Result<u64, StoreError> {
        let mut conn = self.conn.clone();
        let pattern = format!("{}*", self.prefix);
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(500)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                let n: u64 = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await?;
                deleted += n;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }
}

impl LimitStore for RedisStore {
    async fn take(
        &self,
        scopes: &[ScopeLimits],
        tokens: u64,
        lease: &str,
    ) -> Result<Decision, StoreError> {
        let limited: Vec<(usize, &ScopeLimits)> = scopes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_limited())
            .collect();
        let Some(&(_, last)) = limited.last() else {
            return Ok(Decision::Admitted(Figures::default()));
        };
        let mut inv = self.take.prepare_invoke();
        let mut args = vec![
            tokens.to_string(),
            lease.to_string(),
            self.ttl_ms().to_string(),
        ];
        for (_, s) in &limited {
            for k in self.keys(&s.id) {
                inv.key(k);
            }
            scope_args(s, &mut args);
        }
        self.push_now(&mut args);
        for a in &args {
            inv.arg(a);
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = inv.invoke_async(&mut conn).await?;
        match reply.as_slice() {
            [1, rr, rreset, tr, treset] => Ok(Decision::Admitted(last_figures(
                scopes,
                last,
                [*rr, *rreset, *tr, *treset],
            ))),
            [0, i, kind, retry] => {
                let (scope, limit) = refusal(&reply, &limited, *i, *kind)?;
                Ok(Decision::Refused {
                    scope,
                    limit,
                    retry_after: micros(*retry),
                })
            }
            _ => Err(StoreError::Reply(reply)),
        }
    }

    async fn take_slice(
        &self,
        scopes: &[ScopeLimits],
        requests: u64,
        max_tokens: u64,
        min_tokens: u64,
    ) -> Result<SliceDecision, StoreError> {
        let limited: Vec<(usize, &ScopeLimits)> = scopes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.requests.is_some() || s.tokens.is_some())
            .collect();
        let requests = requests.max(1);
        let max_tokens = max_tokens.max(min_tokens);
        let Some(&(_, last)) = limited.last() else {
            return Ok(SliceDecision::Granted(Slice {
                requests,
                tokens: max_tokens,
                figures: Figures::default(),
            }));
        };
        let mut inv = self.slice.prepare_invoke();
        let mut args = vec![
            requests.to_string(),
            max_tokens.to_string(),
            min_tokens.to_string(),
        ];
        for (_, s) in &limited {
            for k in self.keys(&s.id) {
                inv.key(k);
            }
            scope_args(s, &mut args);
        }
        self.push_now(&mut args);
        for a in &args {
            inv.arg(a);
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = inv.invoke_async(&mut conn).await?;
        match reply.as_slice() {
            [1, r, t, rr, rreset, tr, treset] => {
                let figures = last_figures(scopes, last, [*rr, *rreset, *tr, *treset]);
                let count = |v: i64| u64::try_from(v).map_err(|_| StoreError::Reply(reply.clone()));
                Ok(SliceDecision::Granted(Slice {
                    requests: count(*r)?,
                    tokens: count(*t)?,
                    figures,
                }))
            }
            [0, i, kind, retry] => {
                let (scope, limit) = refusal(&reply, &limited, *i, *kind)?;
                Ok(SliceDecision::Refused {
                    scope,
                    limit,
                    retry_after: micros(*retry),
                })
            }
            _ => Err(StoreError::Reply(reply)),
        }
    }

    async fn settle(
        &self,
        scopes: &[ScopeLimits],
        s: Settlement,
        lease: &str,
    ) -> Result<(), StoreError> {
        let mut inv = self.settle.prepare_invoke();
        let mut args = vec![
            s.reserved.to_string(),
            s.actual.to_string(),
            s.give_back_requests.to_string(),
            lease.to_string(),
        ];
        let mut any = false;
        for sc in scopes.iter().filter(|s| s.is_limited()) {
            for k in self.keys(&sc.id) {
                inv.key(k);
            }
            scope_args(sc, &mut args);
            any = true;
        }
        if !any {
            return Ok(());
        }
        self.push_now(&mut args);
        for a in &args {
            inv.arg(a);
        }
        let mut conn = self.conn.clone();
        let _: i64 = inv.invoke_async(&mut conn).await?;
        Ok(())
    }
}
