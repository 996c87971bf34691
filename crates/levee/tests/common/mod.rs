//! What the tests that run the real `levee serve` binary share: in-process servers on
//! ephemeral ports, gateway processes killed with `kill -9` when dropped, the Redis they
//! share (a key prefix of each run's own, deleted at the end) and a few requests.
//!
//! Each test file compiles this module on its own and uses part of it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const REDIS: &str = "redis://127.0.0.1:6379";

/// The API key of tenant `a` in every test configuration.
pub const KEY: &str = "key-a";

/// Serves `app` on an ephemeral loopback port: its base URL.
pub async fn serve(app: axum::Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    format!("http://{addr}")
}

/// A chat completion answering `content` of one token to a prompt of `prompt_tokens`, as an
/// engine sends it.
pub fn completion(content: &str, prompt_tokens: u64) -> axum::Json<Value> {
    axum::Json(json!({"id": "x", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}}))
}

/// The tag a test request carries: its first message's text.
pub fn tag(body: &Value) -> String {
    body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `levee serve` process; dropping it kills it with SIGKILL (`kill -9`).
pub struct Gateway {
    child: Child,
    /// Its public base URL, when the test gave it ports.
    pub base: String,
    /// Its admin base URL, when the test gave it ports.
    pub admin: String,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Gateway {
    /// Starts `levee serve --config <config>` with `env` set.
    pub fn spawn(config: &Path, env: &[(&str, &str)]) -> Gateway {
        let child = Command::new(env!("CARGO_BIN_EXE_levee"))
            .args(["serve", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        Gateway {
            child,
            base: String::new(),
            admin: String::new(),
        }
    }

    /// Writes the configuration `config(port, admin)` gives for this replica's listen ports
    /// to `dir/r{i}.toml` and starts a gateway on it.
    pub fn replica(
        dir: &Path,
        i: usize,
        config: impl FnOnce(u16, u16) -> String,
        env: &[(&str, &str)],
    ) -> Gateway {
        let (port, admin) = (free_port(), free_port());
        let path = dir.join(format!("r{i}.toml"));
        std::fs::write(&path, config(port, admin)).unwrap();
        let mut g = Gateway::spawn(&path, env);
        g.base = format!("http://127.0.0.1:{port}");
        g.admin = format!("http://127.0.0.1:{admin}");
        g
    }
}

/// Waits until the gateway at `base` answers.
pub async fn ready(c: &reqwest::Client, base: &str) {
    for _ in 0..400 {
        if c.get(format!("{base}/healthz")).send().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the gateway never came up at {base}");
}

/// Task `id` as tenant `a` sees it.
pub async fn task(c: &reqwest::Client, base: &str, id: &str) -> Value {
    c.get(format!("{base}/v1/tasks/{id}"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls task `id` until its status is `want` (for up to 20 s): the task then.
pub async fn wait_status(c: &reqwest::Client, base: &str, id: &str, want: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..800 {
        last = task(c, base, id).await;
        if last["status"] == want {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("task {id} never reached {want}: {last}");
}

/// The Redis on 127.0.0.1:6379 and a key prefix of this run's own (`levee-test:{name}:…`),
/// or `None` with a message when Redis is unreachable — a failure instead when
/// `LEVEE_REQUIRE_REDIS=1`.
pub async fn redis_or_skip(name: &str) -> Option<(redis::aio::MultiplexedConnection, String)> {
    let Some(conn) = redis().await else {
        assert!(
            std::env::var("LEVEE_REQUIRE_REDIS").as_deref() != Ok("1"),
            "LEVEE_REQUIRE_REDIS=1 but Redis on 127.0.0.1:6379 is unreachable"
        );
        eprintln!("SKIPPED: Redis on 127.0.0.1:6379 is unreachable; set LEVEE_REQUIRE_REDIS=1 to fail instead");
        return None;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some((
        conn,
        format!("levee-test:{name}:{}:{nanos}:", std::process::id()),
    ))
}

async fn redis() -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(REDIS).ok()?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()?;
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
    (pong == "PONG").then_some(conn)
}

/// Deletes every key under `prefix`.
pub async fn clear(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: i64 = redis::cmd("DEL").arg(keys).query_async(conn).await.unwrap();
    }
}

/// A fresh, empty directory for a test's files.
pub fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("levee-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
