//! Where async tasks live: a small [`TaskStore`] trait and its one implementation on redb,
//! an embedded, crash-safe key-value store (every write transaction is durable when
//! `commit` returns, so a task acknowledged with 202 survives `kill -9`).
//!
//! Every state change goes through [`TaskStore::update`], a read-modify-write inside one
//! write transaction: two writers (a worker finishing, a client cancelling, the expiry
//! sweep) cannot both move a task to a final state, which is what gives each task exactly
//! one final result.

use redb::{ReadableDatabase, ReadableTable};
use serde::{Deserialize, Serialize};
use std::path::Path;

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
    /// No more attempts will be made (delivered, or out of attempts).
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
}

fn db_err(e: impl Into<redb::Error>) -> StoreError {
    StoreError::Db(e.into().to_string())
}

/// Durable task storage. Implementations must make each call atomic and durable on return.
pub trait TaskStore: Send + Sync {
    /// Adds a new task.
    fn insert(&self, task: &Task) -> Result<(), StoreError>;
    /// The task with `id`.
    fn get(&self, id: &str) -> Result<Option<Task>, StoreError>;
    /// Applies `change` to the task atomically; `change` returns `false` to leave it as it
    /// is. Returns the task after the change when one was made.
    fn update(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut Task) -> bool,
    ) -> Result<Option<Task>, StoreError>;
    /// Up to `limit` tasks of `tenant` with ids after `after`, oldest first.
    fn list(
        &self,
        tenant: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Task>, StoreError>;
    /// Every task, in submission order.
    fn all(&self) -> Result<Vec<Task>, StoreError>;
    /// Removes a task.
    fn remove(&self, id: &str) -> Result<(), StoreError>;
}

const TASKS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("tasks");
const BY_TENANT: redb::TableDefinition<(&str, &str), ()> =
    redb::TableDefinition::new("tasks_by_tenant");

/// The redb store: one file, a table of tasks by id (JSON records) and an index by
/// (tenant, id) for listing.
pub struct RedbStore {
    db: redb::Database,
}

impl std::fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbStore").finish_non_exhaustive()
    }
}

fn decode(id: &str, bytes: &[u8]) -> Result<Task, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Decode {
        id: id.to_string(),
        why: e.to_string(),
    })
}

fn encode(t: &Task) -> Result<Vec<u8>, StoreError> {
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
        Ok(RedbStore { db })
    }
}

impl TaskStore for RedbStore {
    fn insert(&self, task: &Task) -> Result<(), StoreError> {
        let bytes = encode(task)?;
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
        let changed = {
            let mut t = tx.open_table(TASKS).map_err(db_err)?;
            let current = match t.get(id).map_err(db_err)? {
                Some(v) => Some(decode(id, v.value())?),
                None => None,
            };
            match current {
                Some(mut task) => {
                    if change(&mut task) {
                        let bytes = encode(&task)?;
                        t.insert(id, bytes.as_slice()).map_err(db_err)?;
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

    #[test]
    fn store_survives_reopen_and_lists_per_tenant_in_order() {
        let dir = std::env::temp_dir().join(format!("levee-store-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        {
            let s = RedbStore::open(&dir).unwrap();
            for i in 0..5 {
                s.insert(&task(i, if i % 2 == 0 { "a" } else { "b" }))
                    .unwrap();
            }
            // A change that says "no" leaves the record alone.
            assert!(s
                .update(&task(1, "b").id, &mut |_| false)
                .unwrap()
                .is_none());
            let done = s
                .update(&task(2, "a").id, &mut |t| {
                    t.status = Status::Succeeded;
                    true
                })
                .unwrap();
            assert_eq!(done.unwrap().status, Status::Succeeded);
        }
        let s = RedbStore::open(&dir).unwrap();
        let all: Vec<u64> = s.all().unwrap().iter().map(|t| t.seq).collect();
        assert_eq!(all, vec![0, 1, 2, 3, 4]);
        let a: Vec<u64> = s
            .list("a", None, 10)
            .unwrap()
            .iter()
            .map(|t| t.seq)
            .collect();
        assert_eq!(a, vec![0, 2, 4]);
        let page2: Vec<u64> = s
            .list("a", Some(&task(0, "a").id), 1)
            .unwrap()
            .iter()
            .map(|t| t.seq)
            .collect();
        assert_eq!(page2, vec![2]);
        assert_eq!(
            s.get(&task(2, "a").id).unwrap().unwrap().status,
            Status::Succeeded
        );
        s.remove(&task(2, "a").id).unwrap();
        assert!(s.get(&task(2, "a").id).unwrap().is_none());
        assert_eq!(s.list("a", None, 10).unwrap().len(), 2);
        let _ = std::fs::remove_file(&dir);
    }
}
