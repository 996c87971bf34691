//! Where async tasks live: the [`TaskStore`] trait and its two implementations.
//!
//! * [`RedbStore`] (the default): redb, an embedded, crash-safe key-value store of one
//!   replica (every write transaction is durable when `commit` returns, so a task
//!   acknowledged with 202 survives `kill -9`). Its queue is this replica's alone.
//! * [`crate::task_store_redis::RedisTaskStore`] (`[state] backend = "redis"`): records in
//!   Redis and the work in a Redis Stream read by a consumer group that every replica
//!   joins, so any replica accepts, runs and answers for any task.
//!
//! Every state change goes through [`TaskStore::update`], an atomic read-modify-write (one
//! redb write transaction; in Redis a compare-and-set script on the record's version): two
//! writers (a worker finishing, a client cancelling, the expiry sweep, another replica)
//! cannot both move a task to a final state, which is what gives each task exactly one
//! final result.

use futures::future::BoxFuture;
use parking_lot::Mutex;
use redb::{ReadableDatabase, ReadableTable};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A task's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Waiting for the band or in the fair queue.
    Queued,
    /// Sent to a backend.
    Running,
    /// Finished; `result` holds the backend's response.
    Succeeded,
    /// Finished with an error; `error` holds it (OpenAI shape).
    Failed,
    /// Cancelled by its tenant.
    Cancelled,
    /// Still queued `tasks.max_queue_ms` after submission.
    Expired,
}

impl Status {
    /// The name clients see (`queued`, `succeeded`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Running => "running",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
            Status::Expired => "expired",
        }
    }

    /// Whether no further change can happen.
    pub fn is_final(self) -> bool {
        !matches!(self, Status::Queued | Status::Running)
    }
}

/// Where a task's callback stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallbackState {
    /// The receiver answered 2xx.
    pub delivered: bool,
    /// POSTs tried so far.
    pub attempts: u32,
    /// No more attempts will be made (delivered, refused by policy, or out of attempts).
    pub done: bool,
    /// The last failure, for the tenant to read.
    pub last_error: Option<String>,
}

/// One task as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// `task_` + 16 hex digits of the submission sequence + 8 random hex digits: sorting
    /// ids sorts by submission.
    pub id: String,
    /// Submission order (restart re-queues in this order).
    pub seq: u64,
    /// Owner.
    pub tenant: String,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub endpoint: String,
    /// The requested model.
    pub model: String,
    /// The request body as sent upstream (without `callback_url`).
    pub body: String,
    /// Where to POST the final state.
    pub callback_url: Option<String>,
    /// Current state.
    pub status: Status,
    /// Unix milliseconds.
    pub created_ms: u64,
    /// When it was last sent to a backend.
    pub started_ms: Option<u64>,
    /// When it reached its final state.
    pub finished_ms: Option<u64>,
    /// Times it was sent to a backend (more than one after a restart while running).
    pub attempts: u32,
    /// The backend's response (succeeded).
    pub result: Option<serde_json::Value>,
    /// The error (failed, cancelled, expired), OpenAI-shaped.
    pub error: Option<serde_json::Value>,
    /// Callback delivery, when a `callback_url` was given.
    pub callback: Option<CallbackState>,
}

/// A store failure; the message says what failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed (I/O, corruption, a full disk).
    #[error("task store: {0}")]
    Db(String),
    /// A stored record does not decode.
    #[error("task store: record {id} does not decode: {why}")]
    Decode {
        /// The task id.
        id: String,
        /// The decoder's message.
        why: String,
    },
    /// A Redis command failed or timed out.
    #[error(
        "task store: Redis at {url} failed to {what} ({source}); check that the server in \
         [state] url is up and reachable"
    )]
    Redis {
        /// The server (password hidden).
        url: String,
        /// The operation.
        what: &'static str,
        /// The client's error.
        source: redis::RedisError,
    },
    /// Redis answered something the task scripts never answer.
    #[error(
        "task store: Redis at {url} answered {reply} to {what}, which this levee does not \
         understand; check that [state] url points at Redis 6.2 or later (or Valkey)"
    )]
    Reply {
        /// The server (password hidden).
        url: String,
        /// The operation.
        what: &'static str,
        /// The reply, printed.
        reply: String,
    },
    /// Other writers kept changing the record between this one's read and write.
    #[error("task store: task {0} changed under every one of 16 attempts to update it")]
    Contended(String),
}

fn db_err(e: impl Into<redb::Error>) -> StoreError {
    StoreError::Db(e.into().to_string())
}

/// A boxed store call.
pub type StoreFuture<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// A change to a task: returns `false` to leave it as it is. It may run more than once (a
/// store that lost a race reads the record again and retries).
pub type Change = Box<dyn FnMut(&mut Task) -> bool + Send>;

/// The outcome of [`TaskStore::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// Stored and queued.
    Stored,
    /// Not stored: the tenant already has `open` tasks queued or running, its limit.
    Full {
        /// The tenant's unfinished tasks.
        open: u32,
    },
}

/// Where a task held by this replica stands, from [`TaskStore::renew`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Still this replica's: its visibility timeout starts again.
    Kept,
    /// Another replica claimed it (this one was silent past the visibility timeout): let
    /// it go.
    Lost,
    /// Final (cancelled or expired elsewhere) or removed: stop working on it.
    Finished,
}

/// Tasks handed to this replica by [`TaskStore::claim`].
#[derive(Debug, Default)]
pub struct Claimed {
    /// The tasks, queued (a re-claimed running task was set back to queued).
    pub tasks: Vec<Task>,
    /// How many of them another replica held past the visibility timeout.
    pub reclaimed: usize,
}

/// Task storage. Each call is atomic and durable on return.
pub trait TaskStore: Send + Sync {
    /// Whether the queue is shared by a fleet (work is handed out by [`TaskStore::claim`])
    /// rather than this replica's own (everything submitted here runs here).
    fn shared(&self) -> bool;
    /// The next submission sequence number (unique in the store, increasing).
    fn next_seq(&self) -> StoreFuture<'_, u64>;
    /// Adds a new queued task, unless its tenant already has `max_open` tasks queued or
    /// running.
    fn insert<'a>(&'a self, task: &'a Task, max_open: u32) -> StoreFuture<'a, Inserted>;
    /// The task with `id`.
    fn get<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<Task>>;
    /// Applies `change` atomically; returns the task after the change when one was made.
    fn update<'a>(&'a self, id: &'a str, change: Change) -> StoreFuture<'a, Option<Task>>;
    /// Up to `limit` tasks of `tenant` with ids after `after`, oldest first.
    fn list<'a>(
        &'a self,
        tenant: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> StoreFuture<'a, Vec<Task>>;
    /// At start: the tasks this replica must take back — for a local store every task
    /// (running ones set back to queued: they are sent upstream again), for a shared store
    /// none (the shared queue hands them out).
    fn recover(&self) -> StoreFuture<'_, Vec<Task>>;
    /// Tasks still queued that were submitted before `before_ms` (Unix ms), at most a
    /// page of them.
    fn queued_before(&self, before_ms: u64) -> StoreFuture<'_, Vec<Task>>;
    /// Removes final tasks whose callbacks are done and that finished before `before_ms`;
    /// returns how many. (A store that expires records by itself removes none here.)
    fn purge(&self, before_ms: u64) -> StoreFuture<'_, usize>;
    /// Shared queue only: up to `max` tasks for this replica to run, taken from the shared
    /// queue (first those another replica held past the visibility timeout).
    fn claim(&self, max: usize) -> StoreFuture<'_, Claimed>;
    /// Shared queue only: keeps the tasks `ids` this replica holds, and says for each
    /// (same order) whether it still does.
    fn renew<'a>(&'a self, ids: &'a [String]) -> StoreFuture<'a, Vec<Held>>;
    /// Shared queue only: hands the tasks `ids` this replica holds back to the queue at
    /// once (a clean shutdown), so other replicas claim them without waiting for the
    /// visibility timeout.
    fn release<'a>(&'a self, ids: &'a [String]) -> StoreFuture<'a, ()>;
    /// Shared queue only: keeps the leases on the callback deliveries `delivering` this
    /// replica runs, and takes up to `max` deliveries whose replica stopped keeping them
    /// (it died, or shut down), returning their tasks. The final write of a task with a
    /// callback gives its writer the first lease.
    fn callbacks<'a>(&'a self, delivering: &'a [String], max: usize) -> StoreFuture<'a, Vec<Task>>;
    /// Shared queue only: hands the callback deliveries `delivering` back at once (a clean
    /// shutdown).
    fn release_callbacks<'a>(&'a self, delivering: &'a [String]) -> StoreFuture<'a, ()>;
    /// The callback of task `id` needs no more attempts (delivered or given up).
    fn callback_done<'a>(&'a self, id: &'a str) -> StoreFuture<'a, ()>;
    /// Shared queue only: the unfinished tasks submitted before task `id` still in the
    /// shared queue (waiting or running anywhere in the fleet), counted up to 1000.
    fn ahead<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<usize>>;
}

const TASKS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("tasks");
const BY_TENANT: redb::TableDefinition<(&str, &str), ()> =
    redb::TableDefinition::new("tasks_by_tenant");

/// The redb store: one file, a table of tasks by id (JSON records) and an index by
/// (tenant, id) for listing. Calls run on tokio's blocking pool: a durable commit waits for
/// the disk (fsync), and a worker thread stalled on it would stall every request it serves.
#[derive(Clone)]
pub struct RedbStore {
    inner: Arc<Redb>,
}

struct Redb {
    db: redb::Database,
    /// The next sequence number.
    seq: AtomicU64,
    /// Unfinished tasks per tenant (the submit quota).
    open: Mutex<HashMap<String, u32>>,
}

impl std::fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStore").finish_non_exhaustive()
    }
}

pub(crate) fn decode(id: &str, bytes: &[u8]) -> Result<Task, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Decode {
        id: id.to_string(),
        why: e.to_string(),
    })
}

pub(crate) fn encode(t: &Task) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(t).map_err(|e| StoreError::Decode {
        id: t.id.clone(),
        why: e.to_string(),
    })
}

impl RedbStore {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        let db = redb::Database::create(path).map_err(|e| {
            StoreError::Db(format!(
                "cannot open {} ({e}); check the directory exists and is writable, and that \
                 no other gateway holds the file",
                path.display()
            ))
        })?;
        // Create the tables, so reads on a new file find them.
        let tx = db.begin_write().map_err(db_err)?;
        tx.open_table(TASKS).map_err(db_err)?;
        tx.open_table(BY_TENANT).map_err(db_err)?;
        tx.commit().map_err(db_err)?;
        let inner = Redb {
            db,
            seq: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        };
        let all = inner.all()?;
        let next = all.iter().map(|t| t.seq + 1).max().unwrap_or(0);
        inner.seq.store(next, Ordering::SeqCst);
        {
            let mut open = inner.open.lock();
            for t in all.iter().filter(|t| !t.status.is_final()) {
                *open.entry(t.tenant.clone()).or_default() += 1;
            }
        }
        Ok(RedbStore {
            inner: Arc::new(inner),
        })
    }

    /// Runs `f` on the blocking pool.
    fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Redb) -> Result<R, StoreError> + Send + 'static,
    ) -> StoreFuture<'static, R> {
        let inner = self.inner.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || f(&inner))
                .await
                .unwrap_or_else(|e| {
                    Err(StoreError::Db(format!("a store call did not finish: {e}")))
                })
        })
    }
}

impl Redb {
    fn insert(&self, task: &Task, max_open: u32) -> Result<Inserted, StoreError> {
        let bytes = encode(task)?;
        {
            let mut open = self.open.lock();
            let n = open.entry(task.tenant.clone()).or_default();
            if *n >= max_open {
                return Ok(Inserted::Full { open: *n });
            }
            *n += 1;
        }
        let stored = (|| {
            let tx = self.db.begin_write().map_err(db_err)?;
            {
                let mut t = tx.open_table(TASKS).map_err(db_err)?;
                t.insert(task.id.as_str(), bytes.as_slice())
                    .map_err(db_err)?;
                let mut idx = tx.open_table(BY_TENANT).map_err(db_err)?;
                idx.insert((task.tenant.as_str(), task.id.as_str()), ())
                    .map_err(db_err)?;
            }
            tx.commit().map_err(db_err)
        })();
        if stored.is_err() {
            self.closed(&task.tenant);
        }
        stored.map(|()| Inserted::Stored)
    }

    /// One of `tenant`'s tasks reached its final state (or was never stored).
    fn closed(&self, tenant: &str) {
        if let Some(n) = self.open.lock().get_mut(tenant) {
            *n = n.saturating_sub(1);
        }
    }

    fn get(&self, id: &str) -> Result<Option<Task>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let t = tx.open_table(TASKS).map_err(db_err)?;
        match t.get(id).map_err(db_err)? {
            Some(v) => decode(id, v.value()).map(Some),
            None => Ok(None),
        }
    }

    fn update(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut Task) -> bool,
    ) -> Result<Option<Task>, StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        let mut closed = None;
        let changed = {
            let mut t = tx.open_table(TASKS).map_err(db_err)?;
            let current = match t.get(id).map_err(db_err)? {
                Some(v) => Some(decode(id, v.value())?),
                None => None,
            };
            match current {
                Some(mut task) => {
                    let was_final = task.status.is_final();
                    if change(&mut task) {
                        let bytes = encode(&task)?;
                        t.insert(id, bytes.as_slice()).map_err(db_err)?;
                        if !was_final && task.status.is_final() {
                            closed = Some(task.tenant.clone());
                        }
                        Some(task)
                    } else {
                        None
                    }
                }
                None => None,
            }
        };
        if changed.is_some() {
            tx.commit().map_err(db_err)?;
            if let Some(tenant) = closed {
                self.closed(&tenant);
            }
        } else {
            tx.abort().map_err(db_err)?;
        }
        Ok(changed)
    }

    fn list(
        &self,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Task>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let idx = tx.open_table(BY_TENANT).map_err(db_err)?;
        let tasks = tx.open_table(TASKS).map_err(db_err)?;
        let mut out = Vec::new();
        let start = (tenant, after.unwrap_or(""));
        for entry in idx.range(start..).map_err(db_err)? {
            let (k, _) = entry.map_err(db_err)?;
            let (owner, id) = k.value();
            if owner != tenant {
                break;
            }
            if Some(id) == after {
                continue;
            }
            if let Some(v) = tasks.get(id).map_err(db_err)? {
                out.push(decode(id, v.value())?);
            }
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// Every task, in submission order.
    fn all(&self) -> Result<Vec<Task>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let t = tx.open_table(TASKS).map_err(db_err)?;
        let mut out = Vec::new();
        for entry in t.iter().map_err(db_err)? {
            let (k, v) = entry.map_err(db_err)?;
            out.push(decode(k.value(), v.value())?);
        }
        Ok(out)
    }

    fn recover(&self) -> Result<Vec<Task>, StoreError> {
        let mut all = self.all()?;
        let mut requeued = 0;
        for t in all.iter_mut().filter(|t| t.status == Status::Running) {
            let back = self.update(&t.id, &mut |s| {
                if s.status != Status::Running {
                    return false;
                }
                s.status = Status::Queued;
                true
            })?;
            if let Some(back) = back {
                *t = back;
                requeued += 1;
            }
        }
        if requeued > 0 {
            tracing::warn!("{requeued} tasks were running when the gateway stopped; queued again");
        }
        Ok(all)
    }

    fn remove(&self, id: &str) -> Result<(), StoreError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut t = tx.open_table(TASKS).map_err(db_err)?;
            let tenant = match t.remove(id).map_err(db_err)? {
                Some(v) => Some(decode(id, v.value())?.tenant),
                None => None,
            };
            if let Some(tenant) = tenant {
                let mut idx = tx.open_table(BY_TENANT).map_err(db_err)?;
                idx.remove((tenant.as_str(), id)).map_err(db_err)?;
            }
        }
        tx.commit().map_err(db_err)
    }

    fn purge(&self, before_ms: u64) -> Result<usize, StoreError> {
        let mut n = 0;
        for t in self.all()? {
            if t.status.is_final()
                && t.callback.as_ref().is_none_or(|c| c.done)
                && t.finished_ms.is_some_and(|f| f < before_ms)
            {
                self.remove(&t.id)?;
                n += 1;
            }
        }
        Ok(n)
    }
}

impl TaskStore for RedbStore {
    fn shared(&self) -> bool {
        false
    }

    fn next_seq(&self) -> StoreFuture<'_, u64> {
        let n = self.inner.seq.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move { Ok(n) })
    }

    fn insert<'a>(&'a self, task: &'a Task, max_open: u32) -> StoreFuture<'a, Inserted> {
        let task = task.clone();
        self.blocking(move |db| db.insert(&task, max_open))
    }

    fn get<'a>(&'a self, id: &'a str) -> StoreFuture<'a, Option<Task>> {
        let id = id.to_string();
        self.blocking(move |db| db.get(&id))
    }

    fn update<'a>(&'a self, id: &'a str, mut change: Change) -> StoreFuture<'a, Option<Task>> {
        let id = id.to_string();
        self.blocking(move |db| db.update(&id, &mut *change))
    }

    fn list<'a>(
        &'a self,
        tenant: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> StoreFuture<'a, Vec<Task>> {
        let (tenant, after) = (tenant.to_string(), after.map(str::to_string));
        self.blocking(move |db| db.list(&tenant, after.as_deref(), limit))
    }

    fn recover(&self) -> StoreFuture<'_, Vec<Task>> {
        self.blocking(Redb::recover)
    }

    fn queued_before(&self, before_ms: u64) -> StoreFuture<'_, Vec<Task>> {
        self.blocking(move |db| {
            Ok(db
                .all()?
                .into_iter()
                .filter(|t| t.status == Status::Queued && t.created_ms < before_ms)
                .collect())
        })
    }

    fn purge(&self, before_ms: u64) -> StoreFuture<'_, usize> {
        self.blocking(move |db| db.purge(before_ms))
    }

    fn claim(&self, _max: usize) -> StoreFuture<'_, Claimed> {
        Box::pin(async { Ok(Claimed::default()) })
    }

    fn renew<'a>(&'a self, ids: &'a [String]) -> StoreFuture<'a, Vec<Held>> {
        let kept = vec![Held::Kept; ids.len()];
        Box::pin(async move { Ok(kept) })
    }

    fn release<'a>(&'a self, _ids: &'a [String]) -> StoreFuture<'a, ()> {
        Box::pin(async { Ok(()) })
    }

    fn callbacks<'a>(
        &'a self,
        _delivering: &'a [String],
        _max: usize,
    ) -> StoreFuture<'a, Vec<Task>> {
        // Undelivered callbacks come back with `recover` at the next start.
        Box::pin(async { Ok(Vec::new()) })
    }

    fn release_callbacks<'a>(&'a self, _delivering: &'a [String]) -> StoreFuture<'a, ()> {
        Box::pin(async { Ok(()) })
    }

    fn callback_done<'a>(&'a self, _id: &'a str) -> StoreFuture<'a, ()> {
        // The record's `callback.done` is the state.
        Box::pin(async { Ok(()) })
    }

    fn ahead<'a>(&'a self, _id: &'a str) -> StoreFuture<'a, Option<usize>> {
        Box::pin(async { Ok(None) })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn task(seq: u64, tenant: &str) -> Task {
        Task {
            id: format!("task_{seq:016x}00000000"),
            seq,
            tenant: tenant.into(),
            endpoint: "/v1/chat/completions".into(),
            model: "m".into(),
            body: "{}".into(),
            callback_url: None,
            status: Status::Queued,
            created_ms: seq,
            started_ms: None,
            finished_ms: None,
            attempts: 0,
            result: None,
            error: None,
            callback: None,
        }
    }

    #[tokio::test]
    async fn store_survives_reopen_lists_per_tenant_and_counts_open_tasks() {
        let dir = std::env::temp_dir().join(format!("levee-store-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        {
            let s = RedbStore::open(&dir).unwrap();
            for i in 0..5 {
                let seq = s.next_seq().await.unwrap();
                assert_eq!(seq, i);
                let t = task(seq, if i % 2 == 0 { "a" } else { "b" });
                assert_eq!(s.insert(&t, 3).await.unwrap(), Inserted::Stored);
            }
            // "a" has three open tasks: its limit.
            assert_eq!(
                s.insert(&task(99, "a"), 3).await.unwrap(),
                Inserted::Full { open: 3 }
            );
            // A change that says "no" leaves the record alone.
            let id1 = task(1, "b").id;
            assert!(s.update(&id1, Box::new(|_| false)).await.unwrap().is_none());
            let done = s
                .update(
                    &task(2, "a").id,
                    Box::new(|t| {
                        t.status = Status::Succeeded;
                        t.finished_ms = Some(10);
                        true
                    }),
                )
                .await
                .unwrap();
            assert_eq!(done.unwrap().status, Status::Succeeded);
            // One of "a"'s tasks is final: room for one more.
            assert_eq!(s.insert(&task(5, "a"), 3).await.unwrap(), Inserted::Stored);
        }
        let s = RedbStore::open(&dir).unwrap();
        // The sequence and the open counts are rebuilt from the file.
        assert_eq!(s.next_seq().await.unwrap(), 6);
        assert_eq!(
            s.insert(&task(6, "a"), 3).await.unwrap(),
            Inserted::Full { open: 3 }
        );
        let a: Vec<u64> = s
            .list("a", None, 10)
            .await
            .unwrap()
            .iter()
            .map(|t| t.seq)
            .collect();
        assert_eq!(a, vec![0, 2, 4, 5]);
        let page2: Vec<u64> = s
            .list("a", Some(&task(0, "a").id), 1)
            .await
            .unwrap()
            .iter()
            .map(|t| t.seq)
            .collect();
        assert_eq!(page2, vec![2]);
        let queued: Vec<u64> = s
            .queued_before(3)
            .await
            .unwrap()
            .iter()
            .map(|t| t.seq)
            .collect();
        assert_eq!(queued, vec![0, 1]);
        // Only the final task finished before the cutoff goes.
        assert_eq!(s.purge(10).await.unwrap(), 0);
        assert_eq!(s.purge(11).await.unwrap(), 1);
        assert!(s.get(&task(2, "a").id).await.unwrap().is_none());
        assert_eq!(s.list("a", None, 10).await.unwrap().len(), 3);
        let _ = std::fs::remove_file(&dir);
    }
}
