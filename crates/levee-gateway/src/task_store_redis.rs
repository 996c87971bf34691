//! Async tasks on Redis (`[state] backend = "redis"`): any replica accepts, runs and answers
//! for any task.
//!
//! * **Records.** Each task is a hash `<prefix>task:v1:<id>`: `json` (the [`Task`]),
//!   `status` (for the scripts), `v` (a version bumped by every write), `entry` (its stream
//!   entry) and `finals` (how many times it moved to a final state: 1, by construction).
//!   Every change is a compare-and-set on `v` ([`TaskStore::update`] retries on a lost
//!   race), and a final state is only written over an unfinished one, so two replicas
//!   racing produce exactly one final result. A final record expires after
//!   `tasks.result_retention_ms`.
//! * **The queue** is the stream `<prefix>tasks:v1:queue` with one consumer group
//!   (`levee`) that every replica joins as the consumer named by its replica id. A replica
//!   reads new entries (`XREADGROUP`) only when its band has room, resets the idle time of
//!   the entries it holds on every tick (`XCLAIM` to itself, only while it still owns
//!   them), and claims entries idle past `tasks.visibility_ms` (`XAUTOCLAIM`): those of a
//!   replica that died. A replica that shuts down cleanly hands its entries back by setting
//!   their idle time to the visibility timeout. The final write acknowledges and deletes the entry, so the stream
//!   holds the unfinished tasks only.
//! * **Per tenant**: `<prefix>tasks:v1:by-tenant:<tenant>` (ids scored by sequence, for
//!   listing; pruned as records expire) and `<prefix>tasks:v1:open:<tenant>` (unfinished
//!   tasks, checked and counted by the submit script: the quota is fleet-wide).
//!   `<prefix>tasks:v1:seq` numbers submissions fleet-wide, so ids sort in submission order.
//! * **Callbacks**: `<prefix>tasks:v1:callbacks` holds the deliveries in progress, each
//!   under a lease (`visibility_ms`) its replica renews every tick; the final write gives
//!   the first lease to its writer, and a lapsed or handed-back lease is taken over.

use crate::task_store::{
    decode, encode, Change, Claimed, Held, Inserted, Status, StoreError, StoreFuture, Task,
    TaskStore,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The version of the task scripts and of the record layout, part of every key name.
pub const TASK_SCRIPT_VERSION: u32 = 1;
/// The consumer group every replica joins.
const GROUP: &str = "levee";
/// The longest a task command waits for Redis (tasks are off the latency-critical path).
const TIMEOUT: Duration = Duration::from_secs(2);
/// Compare-and-set attempts before giving up.
const CAS_ATTEMPTS: usize = 16;
/// Entries examined per expiry sweep; the rest wait for the next sweep.
const SWEEP_PAGE: usize = 100;
/// `ahead` counts up to this many entries.
const AHEAD_CAP: usize = 1000;
/// Consumers idle this many visibility timeouts with nothing pending are removed from the
/// group, looked for at most this often.
const STALE_CONSUMER_VISIBILITIES: u32 = 10;

const INSERT: &str = include_str!("scripts/task_insert.lua");
const UPDATE: &str = include_str!("scripts/task_update.lua");
const RENEW: &str = include_str!("scripts/task_renew.lua");
const TIDY: &str = include_str!("scripts/task_tidy.lua");
const CALLBACKS: &str = include_str!("scripts/task_callbacks.lua");

/// Tasks in Redis, the queue a stream shared by the fleet.
pub struct RedisTaskStore {
    conn: ConnectionManager,
    /// The server, password hidden (for messages).
    url: String,
    prefix: String,
    consumer: String,
    visibility: Duration,
    retention: Duration,
    /// Lifetime of a tenant's index after its last submission.
    index_ttl: Duration,
    group_ready: AtomicBool,
    /// When this replica last removed stale consumers from the group.
    last_tidy: parking_lot::Mutex<Option<std::time::Instant>>,
    insert: Script,
    update: Script,
    renew: Script,
    tidy: Script,
    callbacks: Script,
}

impl std::fmt::Debug for RedisTaskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTaskStore")
            .field("url", &self.url)
            .field("prefix", &self.prefix)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A bulk or simple string reply as text.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Stream entries `[[entry id, [field, value, ...]], ...]` as (entry id, its task id); a
/// deleted entry (nil fields) has no task id.
fn entries(v: &Value) -> Vec<(String, Option<String>)> {
    let Value::Array(items) = v else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|e| {
            let Value::Array(parts) = e else { return None };
            let entry = text(parts.first()?)?;
            let task = match parts.get(1) {
                Some(Value::Array(fields)) => fields
                    .chunks(2)
                    .find(|kv| kv.first().and_then(text).as_deref() == Some("id"))
                    .and_then(|kv| kv.get(1).and_then(text)),
                _ => None,
            };
            Some((entry, task))
        })
        .collect()
}

/// A RESP2 flat `[key, value, ...]` array or a RESP3 map as (key, value) pairs.
fn fields(v: &Value) -> Vec<(String, Value)> {
    match v {
        Value::Array(kv) => kv
            .chunks(2)
            .filter_map(|p| Some((text(p.first()?)?, p.get(1)?.clone())))
            .collect(),
        Value::Map(kv) => kv
            .iter()
            .filter_map(|(k, v)| Some((text(k)?, v.clone())))
            .collect(),
        _ => Vec::new(),
    }
}

/// The sequence number in an id `task_<16 hex digits><8 hex digits>`.
fn seq_of(id: &str) -> Option<u64> {
    u64::from_str_radix(id.get(5..21)?, 16).ok()
}

impl RedisTaskStore {
    /// A store on the server at `url` under `prefix`, this replica reading the queue as
    /// consumer `consumer`. No connection is made here: the first command connects.
    pub fn new(
        url: &str,
        redacted_url: &str,
        prefix: &str,
        consumer: &str,
        visibility: Duration,
        retention: Duration,
        max_queue: Duration,
    ) -> Result<Self, StoreError> {
        let err = |source| StoreError::Redis {
            url: redacted_url.to_string(),
            what: "open a client",
            source,
        };
        let client = redis::Client::open(url).map_err(err)?;
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(TIMEOUT))
            .set_response_timeout(Some(TIMEOUT))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(100));
        let conn = ConnectionManager::new_lazy_with_config(client, cfg).map_err(err)?;
        Ok(RedisTaskStore {
            conn,
            url: redacted_url.to_string(),
            prefix: prefix.to_string(),
            consumer: consumer.to_string(),
            visibility,
            retention,
            index_ttl: retention.saturating_add(max_queue),
            group_ready: AtomicBool::new(false),
            last_tidy: parking_lot::Mutex::new(None),
            insert: Script::new(INSERT),
            update: Script::new(UPDATE),
            renew: Script::new(RENEW),
            tidy: Script::new(TIDY),
            callbacks: Script::new(CALLBACKS),
        })
    }

    fn task_key(&self, id: &str) -> String {
        format!("{}task:v{TASK_SCRIPT_VERSION}:{id}", self.prefix)
    }

    fn queue_key(&self) -> String {
        format!("{}tasks:v{TASK_SCRIPT_VERSION}:queue", self.prefix)
    }

    fn index_key(&self, tenant: &str) -> String {
        format!(
            "{}tasks:v{TASK_SCRIPT_VERSION}:by-tenant:{tenant}",
            self.prefix
        )
    }

    fn open_key(&self, tenant: &str) -> String {
        format!("{}tasks:v{TASK_SCRIPT_VERSION}:open:{tenant}", self.prefix)
    }

    fn callbacks_key(&self) -> String {
        format!("{}tasks:v{TASK_SCRIPT_VERSION}:callbacks", self.prefix)
    }

    fn seq_key(&self) -> String {
        format!("{}tasks:v{TASK_SCRIPT_VERSION}:seq", self.prefix)
    }

    fn err(&self, what: &'static str) -> impl Fn(redis::RedisError) -> StoreError + '_ {
        move |source| StoreError::Redis {
            url: self.url.clone(),
            what,
            source,
        }
    }

    fn bad_reply(&self, what: &'static str, reply: impl std::fmt::Debug) -> StoreError {
        StoreError::Reply {
            url: self.url.clone(),
            what,
            reply: format!("{reply:?}"),
        }
    }

    /// Creates the stream and the consumer group if missing (from the stream's start: a
    /// group lost with a server restart without persistence finds every entry again).
    async fn ensure_group(&self) -> Result<(), StoreError> {
        if self.group_ready.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        let r: Result<Value, redis::RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(self.queue_key())
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match r {
            Ok(_) => {}
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(self.err("create the task queue's consumer group")(e)),
        }
        self.group_ready.store(true, Ordering::Release);
        Ok(())
    }

    /// Runs a stream command of the consumer group, recreating the group once if the
    /// server lost it.
    async fn group_cmd(&self, what: &'static str, cmd: &redis::Cmd) -> Result<Value, StoreError> {
        self.ensure_group().await?;
        let mut conn = self.conn.clone();
        match cmd.query_async::<Value>(&mut conn).await {
            Ok(v) => Ok(v),
            Err(e) if e.code() == Some("NOGROUP") => {
                self.group_ready.store(false, Ordering::Release);
                self.ensure_group().await?;
                cmd.query_async(&mut conn).await.map_err(self.err(what))
            }
            Err(e) => Err(self.err(what)(e)),
        }
    }

    /// The record and its version.
    async fn read(&self, id: &str) -> Result<Option<(Task, String)>, StoreError> {
        let mut conn = self.conn.clone();
        let (json, v): (Option<Vec<u8>>, Option<String>) = redis::cmd("HMGET")
            .arg(self.task_key(id))
            .arg("json")
            .arg("v")
            .query_async(&mut conn)
            .await
            .map_err(self.err("read a task"))?;
        match (json, v) {
            (Some(json), Some(v)) => Ok(Some((decode(id, &json)?, v))),
            _ => Ok(None),
        }
    }

    /// The records of `ids` (None where gone), in one round trip.
    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<Task>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("HGET").arg(self.task_key(id)).arg("json");
        }
        let mut conn = self.conn.clone();
        let raw: Vec<Option<Vec<u8>>> = pipe
            .query_async(&mut conn)
            .await
            .map_err(self.err("read tasks"))?;
        ids.iter()
            .zip(raw)
            .map(|(id, json)| json.map(|j| decode(id, &j)).transpose())
            .collect()
    }

    /// Acknowledges and deletes stream entries whose tasks are final or gone.
    async fn drop_entries(&self, stale: &[String]) -> Result<(), StoreError> {
        if stale.is_empty() {
            return Ok(());
        }
        let q = self.queue_key();
        let mut conn = self.conn.clone();
        let _: () = redis::pipe()
            .cmd("XACK")
            .arg(&q)
            .arg(GROUP)
            .arg(stale)
            .ignore()
            .cmd("XDEL")
            .arg(&q)
            .arg(stale)
            .ignore()
            .query_async(&mut conn)
            .await
            .map_err(self.err("drop finished entries from the task queue"))?;
        Ok(())
    }

    async fn update_inner(&self, id: &str, mut change: Change) -> Result<Option<Task>, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let Some((mut task, v)) = self.read(id).await? else {
                return Ok(None);
            };
            if !change(&mut task) {
                return Ok(None);
            }
            let json = encode(&task)?;
            let mut conn = self.conn.clone();
            let r: i64 = self
                .update
                .key(self.task_key(id))
                .key(self.queue_key())
                .key(self.open_key(&task.tenant))
                .key(self.index_key(&task.tenant))
                .key(self.callbacks_key())
                .arg(&v)
                .arg(json)
                .arg(task.status.as_str())
                .arg(GROUP)
                .arg(ms(self.retention))
                .arg(id)
                .arg(if task.callback_url.is_some() {
                    ms(self.visibility)
                } else {
                    0
                })
                .invoke_async(&mut conn)
                .await
                .map_err(self.err("update a task"))?;
            match r {
                1 => return Ok(Some(task)),
                0 => continue,
                -1 | -2 => return Ok(None),
                other => return Err(self.bad_reply("update a task", other)),
            }
        }
        Err(StoreError::Contended(id.to_string()))
    }

    /// Removes consumers idle for [`STALE_CONSUMER_VISIBILITIES`] visibility timeouts with
    /// nothing pending, at most once per that period: every restart of a replica with a
    /// generated id adds a consumer, and this keeps the group small. Removing one that is
    /// alive but idle costs nothing (Redis creates a consumer again when it is handed an
    /// entry), and one with pending entries is never removed (they would be lost to
    /// `XAUTOCLAIM`).
    async fn tidy(&self) -> Result<(), StoreError> {
        let stale = self.visibility * STALE_CONSUMER_VISIBILITIES;
        {
            let mut last = self.last_tidy.lock();
            if last.is_some_and(|t| t.elapsed() < stale) {
                return Ok(());
            }
            *last = Some(std::time::Instant::now());
        }
        let mut info = redis::cmd("XINFO");
        info.arg("CONSUMERS").arg(self.queue_key()).arg(GROUP);
        let v = self
            .group_cmd("list the task queue's consumers", &info)
            .await?;
        let Value::Array(consumers) = v else {
            return Err(self.bad_reply("list the task queue's consumers", v));
        };
        let stale_ms = i64::try_from(stale.as_millis()).unwrap_or(i64::MAX);
        let mut gone = Vec::new();
        for c in &consumers {
            let fields = fields(c);
            let name = fields
                .iter()
                .find(|(k, _)| k == "name")
                .and_then(|(_, v)| text(v));
            let int = |key: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == key)
                    .and_then(|(_, v)| match v {
                        Value::Int(n) => Some(*n),
                        _ => None,
                    })
            };
            if let (Some(name), Some(0), Some(idle)) = (name, int("pending"), int("idle")) {
                if idle > stale_ms && name != self.consumer {
                    gone.push(name);
                }
            }
        }
        if gone.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        let removed: i64 = self
            .tidy
            .key(self.queue_key())
            .arg(GROUP)
            .arg(&gone)
            .invoke_async(&mut conn)
            .await
            .map_err(self.err("remove idle consumers from the task queue"))?;
        tracing::debug!("removed {removed} idle consumers from the task queue");
        Ok(())
    }

    async fn claim_inner(&self, max: usize) -> Result<Claimed, StoreError> {
        self.tidy().await?;
        let got = self.claim_entries(max).await?;
        let ids: Vec<String> = got.iter().filter_map(|(_, t, _)| t.clone()).collect();
        let mut records = self.read_many(&ids).await?.into_iter();
        let mut out = Claimed::default();
        let mut stale = Vec::new();
        for (entry, task, reclaimed) in got {
            let record = records.next().flatten();
            let (Some(id), Some(t)) = (task, record) else {
                stale.push(entry);
                continue;
            };
            if t.status.is_final() {
                stale.push(entry);
                continue;
            }
            let t = if t.status == Status::Running {
                // Its replica died while it ran: it runs again here.
                match self.requeue_running(&id).await? {
                    Some(b) => b,
                    None => continue,
                }
            } else {
                t
            };
            if reclaimed {
                out.reclaimed += 1;
            }
            out.tasks.push(t);
        }
        self.drop_entries(&stale).await?;
        Ok(out)
    }

    /// Up to `max` stream entries for this consumer: first what a silent replica held past
    /// the visibility timeout (`true`: reclaimed), then new ones; each with its task id.
    async fn claim_entries(
        &self,
        max: usize,
    ) -> Result<Vec<(String, Option<String>, bool)>, StoreError> {
        let q = self.queue_key();
        let mut got: Vec<(String, Option<String>, bool)> = Vec::new();
        let mut auto = redis::cmd("XAUTOCLAIM");
        auto.arg(&q)
            .arg(GROUP)
            .arg(&self.consumer)
            .arg(ms(self.visibility))
            .arg("0-0")
            .arg("COUNT")
            .arg(max);
        let v = self
            .group_cmd("claim tasks idle past the visibility timeout", &auto)
            .await?;
        if let Value::Array(parts) = &v {
            if let Some(list) = parts.get(1) {
                got.extend(entries(list).into_iter().map(|(e, t)| (e, t, true)));
            }
        }
        if got.len() >= max {
            return Ok(got);
        }
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP")
            .arg(GROUP)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max - got.len())
            .arg("STREAMS")
            .arg(&q)
            .arg(">");
        let v = self
            .group_cmd("read new tasks from the queue", &read)
            .await?;
        // [[stream, [entries]]] or nil.
        if let Value::Array(streams) = &v {
            for s in streams {
                if let Value::Array(kv) = s {
                    if let Some(list) = kv.get(1) {
                        got.extend(entries(list).into_iter().map(|(e, t)| (e, t, false)));
                    }
                }
            }
        }
        Ok(got)
    }

    /// A task whose replica died while it ran, queued again; `None` if it has finished
    /// meanwhile.
    async fn requeue_running(&self, id: &str) -> Result<Option<Task>, StoreError> {
        let back = self
            .update_inner(
                id,
                Box::new(|s| {
                    if s.status != Status::Running {
                        return false;
                    }
                    s.status = Status::Queued;
                    true
                }),
            )
            .await?;
        Ok(match back {
            Some(b) => Some(b),
            None => match self.read(id).await? {
                Some((b, _)) if !b.status.is_final() => Some(b),
                _ => None,
            },
        })
    }

    async fn list_inner(
        &self,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Task>, StoreError> {
        let idx = self.index_key(tenant);
        let mut conn = self.conn.clone();
        let mut from = match after {
            None => "-inf".to_string(),
            Some(a) => {
                let score: Option<f64> = redis::cmd("ZSCORE")
                    .arg(&idx)
                    .arg(a)
                    .query_async(&mut conn)
                    .await
                    .map_err(self.err("list tasks"))?;
                match score.map(|s| s as u64).or_else(|| seq_of(a)) {
                    Some(s) => format!("({s}"),
                    None => return Ok(Vec::new()),
                }
            }
        };
        let mut out = Vec::new();
        while out.len() < limit {
            let want = limit - out.len();
            let page: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
                .arg(&idx)
                .arg(&from)
                .arg("+inf")
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(want)
                .query_async(&mut conn)
                .await
                .map_err(self.err("list tasks"))?;
            let Some((_, last)) = page.last() else { break };
            from = format!("({}", *last as u64);
            let ids: Vec<String> = page.iter().map(|(id, _)| id.clone()).collect();
            let mut gone = Vec::new();
            for (id, rec) in ids.iter().zip(self.read_many(&ids).await?) {
                match rec {
                    Some(t) => out.push(t),
                    None => gone.push(id.clone()),
                }
            }
            if !gone.is_empty() {
                // Records past their retention: prune the index.
                let _: i64 = redis::cmd("ZREM")
                    .arg(&idx)
                    .arg(&gone)
                    .query_async(&mut conn)
                    .await
                    .map_err(self.err("prune the task index"))?;
            }
            if page.len() < want {
                break;
            }
        }
        Ok(out)
    }

    async fn queued_before_inner(&self, before_ms: u64) -> Result<Vec<Task>, StoreError> {
        let mut conn = self.conn.clone();
        // Entry ids start with the server's time of submission (ms).
        let v: Value = redis::cmd("XRANGE")
            .arg(self.queue_key())
            .arg("-")
            .arg(before_ms)
            .arg("COUNT")
            .arg(SWEEP_PAGE)
            .query_async(&mut conn)
            .await
            .map_err(self.err("read the task queue"))?;
        let ids: Vec<String> = entries(&v).into_iter().filter_map(|(_, t)| t).collect();
        Ok(self
            .read_many(&ids)
            .await?
            .into_iter()
            .flatten()
            .filter(|t| t.status == Status::Queued && t.created_ms < before_ms)
            .collect())
    }

    /// Gives the entries of the tasks `ids` this replica holds the idle time `idle`.
    async fn renew_inner(&self, ids: &[String], idle: Duration) -> Result<Vec<Held>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.renew.prepare_invoke();
        inv.key(self.queue_key());
        for id in ids {
            inv.key(self.task_key(id));
        }
        inv.arg(GROUP)
            .arg(&self.consumer)
            .arg(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX));
        let mut conn = self.conn.clone();
        let codes: Vec<i64> = inv
            .invoke_async(&mut conn)
            .await
            .map_err(self.err("renew the tasks this replica holds"))?;
        if codes.len() != ids.len() {
            return Err(self.bad_reply("renew the tasks this replica holds", codes));
        }
        codes
            .iter()
            .map(|c| match c {
                1 => Ok(Held::Kept),
                0 => Ok(Held::Lost),
                2 => Ok(Held::Finished),
                _ => Err(self.bad_reply("renew the tasks this replica holds", &codes)),
            })
            .collect()
    }

    /// Renews (or, with `lease` zero, hands back) the callback leases of `delivering` and
    /// takes up to `max` due ones; returns the tasks taken (gone ones are dropped).
    async fn callbacks_inner(
        &self,
        delivering: &[String],
        max: usize,
        lease: Duration,
    ) -> Result<Vec<Task>, StoreError> {
        if delivering.is_empty() && max == 0 {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let taken: Vec<String> = self
            .callbacks
            .key(self.callbacks_key())
            .arg(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX))
            .arg(max)
            .arg(delivering)
            .invoke_async(&mut conn)
            .await
            .map_err(self.err("keep the callback deliveries"))?;
        let mut out = Vec::new();
        for (id, t) in taken.iter().zip(self.read_many(&taken).await?) {
            match t {
                Some(t) => out.push(t),
                None => self.callback_done_inner(id).await?,
            }
        }
        Ok(out)
    }

    async fn callback_done_inner(&self, id: &str) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let _: i64 = redis::cmd("ZREM")
            .arg(self.callbacks_key())
            .arg(id)
            .query_async(&mut conn)
            .await
            .map_err(self.err("finish a callback delivery"))?;
        Ok(())
    }

    async fn ahead_inner(&self, id: &str) -> Result<Option<usize>, StoreError> {
        let mut conn = self.conn.clone();
        let entry: Option<String> = redis::cmd("HGET")
            .arg(self.task_key(id))
            .arg("entry")
            .query_async(&mut conn)
            .await
            .map_err(self.err("read a task"))?;
        let Some(entry) = entry else { return Ok(None) };
        let v: Value = redis::cmd("XRANGE")
            .arg(self.queue_key())
            .arg("-")
            .arg(format!("({entry}"))
            .arg("COUNT")
            .arg(AHEAD_CAP)
            .query_async(&mut conn)
            .await
            .map_err(self.err("read the task queue"))?;
        match v {
            Value::Array(items) => Ok(Some(items.len())),
            other => Err(self.bad_reply("read the task queue", other)),
        }
    }
}

impl TaskStore for RedisTaskStore {
    fn shared(&self) -> bool {
        true
    }

    fn next_seq(&self) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let n: u64 = redis::cmd("INCR")
                .arg(self.seq_key())
                .query_async(&mut conn)
                .await
                .map_err(self.err("number a task"))?;
            Ok(n)
        })
    }

    fn insert<'a>(&'a self, task: &'a Task, max_open: u32) -> StoreFuture<'a, Inserted> {
        Box::pin(async move {
            let json = encode(task)?;
            self.ensure_group().await?;
            let mut conn = self.conn.clone();
            let r: Vec<i64> = self
                .insert
                .key(self.task_key(&task.id))
                .key(self.queue_key())
                .key(self.index_key(&task.tenant))
                .key(self.open_key(&task.tenant))
                .arg(json)
                .arg(&task.id)
                .arg(task.seq)
                .arg(max_open)
                .arg(ms(self.index_ttl))
                .invoke_async(&mut conn)
                .await
                .map_err(self.err("store a task"))?;
            match r.as_slice() {
                [1, _] => Ok(Inserted::Stored),
                [0, open] => Ok(Inserted::Full {
                    open: u32::try_from(*open).unwrap_or(u32::MAX),
                }),
                _ => Err(self.bad_reply("store a task", r)),
            }
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<Task>> {
        Box::pin(async move { Ok(self.read(id).await?.map(|(t, _)| t)) })
    }

    fn update<'a>(&'a self, id: &'a str, change: Change) -> StoreFuture<'a, Option<Task>> {
        Box::pin(self.update_inner(id, change))
    }

    fn list<'a>(
        &'a self,
        tenant: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> StoreFuture<'a, Vec<Task>> {
        Box::pin(self.list_inner(tenant, after, limit))
    }

    fn recover(&self) -> StoreFuture<'_, Vec<Task>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    fn queued_before(&self, before_ms: u64) -> StoreFuture<'_, Vec<Task>> {
        Box::pin(self.queued_before_inner(before_ms))
    }

    fn purge(&self, _before_ms: u64) -> StoreFuture<'_, usize> {
        // Final records expire by themselves (PEXPIRE at the final write).
        Box::pin(async { Ok(0) })
    }

    fn claim(&self, max: usize) -> StoreFuture<'_, Claimed> {
        Box::pin(self.claim_inner(max))
    }

    fn renew<'a>(&'a self, ids: &'a [String]) -> StoreFuture<'a, Vec<Held>> {
        Box::pin(self.renew_inner(ids, Duration::ZERO))
    }

    fn release<'a>(&'a self, ids: &'a [String]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.renew_inner(ids, self.visibility).await?;
            Ok(())
        })
    }

    fn callbacks<'a>(&'a self, delivering: &'a [String], max: usize) -> StoreFuture<'a, Vec<Task>> {
        Box::pin(self.callbacks_inner(delivering, max, self.visibility))
    }

    fn release_callbacks<'a>(&'a self, delivering: &'a [String]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.callbacks_inner(delivering, 0, Duration::ZERO).await?;
            Ok(())
        })
    }

    fn callback_done<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(self.callback_done_inner(id))
    }

    fn ahead<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<usize>> {
        Box::pin(self.ahead_inner(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_entries_parse_with_deleted_ones() {
        let s = |x: &str| Value::BulkString(x.as_bytes().to_vec());
        let v = Value::Array(vec![
            Value::Array(vec![s("1-0"), Value::Array(vec![s("id"), s("task_a")])]),
            Value::Array(vec![s("2-0"), Value::Nil]),
        ]);
        assert_eq!(
            entries(&v),
            vec![("1-0".into(), Some("task_a".into())), ("2-0".into(), None)]
        );
        assert_eq!(seq_of("task_000000000000001f0badcafe"), Some(31));
        assert_eq!(seq_of("task_x"), None);
    }
}
