//! The Redis store: the limiters' arithmetic as atomic Lua scripts.
//!
//! Each decision is one `EVALSHA` (the `redis` crate loads a script on `NOSCRIPT`, e.g.
//! after a server restart). State per scope is one hash whose fields are theoretical
//! arrival times in microseconds of the server's `TIME`, so replicas' clocks never matter.
//! Keys are `<prefix>lim:v<SCRIPT_VERSION>:{<scope>}`: the version keeps replicas running
//! different scripts (a rolling upgrade) on separate state, and the braces are a Redis
//! Cluster hash tag (each scope's state sits in one slot). Keys expire once their bucket has
//! refilled, so idle tenants cost nothing.

use crate::limits::{Decision, Figures, LimitStore, Limited, ScopeLimits, Settlement, StoreError};
use levee_policy::RateLimitInfo;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use std::time::Duration;

/// The version of the Lua scripts, part of every key name.
pub const SCRIPT_VERSION: u32 = 1;

const TAKE: &str = include_str!("scripts/take.lua");
const SETTLE: &str = include_str!("scripts/settle.lua");
const HEARTBEAT: &str = include_str!("scripts/heartbeat.lua");

/// Limits shared through one Redis (or Valkey) server.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    take: Script,
    settle: Script,
    heartbeat: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Five script arguments per scope: request interval and tolerance, token interval and
/// tolerance (µs), token capacity. Zero interval: not limited.
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
}

fn micros(us: i64) -> Duration {
    Duration::from_micros(u64::try_from(us).unwrap_or(0))
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
    /// attempt.
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
            take: Script::new(TAKE),
            settle: Script::new(SETTLE),
            heartbeat: Script::new(HEARTBEAT),
        })
    }

    /// The key of a scope's state.
    fn key(&self, scope: &ScopeLimits) -> String {
        format!("{}lim:v{SCRIPT_VERSION}:{{{}}}", self.prefix, scope.id)
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
    async fn take(&self, scopes: &[ScopeLimits], tokens: u64) -> Result<Decision, StoreError> {
        let limited: Vec<(usize, &ScopeLimits)> = scopes
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_limited())
            .collect();
        let Some(&(_, last)) = limited.last() else {
            return Ok(Decision::Admitted(Figures::default()));
        };
        let mut inv = self.take.prepare_invoke();
        let mut args = vec![tokens.to_string()];
        for (_, s) in &limited {
            inv.key(self.key(s));
            scope_args(s, &mut args);
        }
        for a in &args {
            inv.arg(a);
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = inv.invoke_async(&mut conn).await?;
        match reply.as_slice() {
            [1, rr, rreset, tr, treset] => {
                // Figures are the last scope's; the script reports the last limited one.
                let figures = if scopes.last().is_some_and(|s| s.is_limited()) {
                    Figures {
                        requests: info(last.requests.map(|q| q.burst()), *rr, *rreset),
                        tokens: info(last.tokens.map(|q| q.capacity()), *tr, *treset),
                    }
                } else {
                    Figures::default()
                };
                Ok(Decision::Admitted(figures))
            }
            [0, i, kind, retry] => {
                let pos = usize::try_from(*i - 1)
                    .ok()
                    .and_then(|i| limited.get(i))
                    .ok_or_else(|| StoreError::Reply(reply.clone()))?;
                let limit = match kind {
                    1 => Limited::Requests,
                    2 => Limited::Tokens,
                    3 => Limited::TooLarge {
                        capacity: pos.1.tokens.map_or(0, |q| q.capacity()),
                    },
                    _ => return Err(StoreError::Reply(reply.clone())),
                };
                Ok(Decision::Refused {
                    scope: pos.0,
                    limit,
                    retry_after: micros(*retry),
                })
            }
            _ => Err(StoreError::Reply(reply)),
        }
    }

    async fn settle(&self, scopes: &[ScopeLimits], s: Settlement) -> Result<(), StoreError> {
        let mut inv = self.settle.prepare_invoke();
        let mut args = vec![
            s.reserved.to_string(),
            s.actual.to_string(),
            if s.give_back_request { "1" } else { "0" }.to_string(),
        ];
        let mut any = false;
        for sc in scopes.iter().filter(|s| s.is_limited()) {
            inv.key(self.key(sc));
            scope_args(sc, &mut args);
            any = true;
        }
        if !any {
            return Ok(());
        }
        for a in &args {
            inv.arg(a);
        }
        let mut conn = self.conn.clone();
        let _: i64 = inv.invoke_async(&mut conn).await?;
        Ok(())
    }
}
