//! Callbacks: a finished task's state POSTed to its `callback_url` on a tokio task of its
//! own, signed with HMAC-SHA256 under the tenant's secret, retried with full-jitter
//! exponential backoff.

use super::{unix_ms, Tasks};
use crate::config::TasksConfig;
use crate::egress::EgressPolicy;
use crate::gateway::Gateway;
use crate::task_store::{CallbackState, Task};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

impl Tasks {
    /// Delivers the task's callback on a tokio task of its own (unless this replica is
    /// delivering it already).
    pub(super) fn spawn_callback(self: Arc<Self>, gw: &Arc<Gateway>, task: Task) {
        if !self.delivering.lock().insert(task.id.clone()) {
            return;
        }
        let gw = gw.clone();
        tokio::spawn(async move {
            let id = task.id.clone();
            let done = self.deliver(&gw, task).await;
            self.delivering.lock().remove(&id);
            if done {
                if let Err(e) = self.store.callback_done(&id).await {
                    tracing::warn!("task {id}: {e}");
                }
            }
        });
    }

    /// POSTs the final state to the task's `callback_url`, signed, retried with full-jitter
    /// exponential backoff; the outcome is stored with the task. Returns whether it is
    /// over (delivered, or no attempt left); `false` when the gateway stopped first.
    async fn deliver(self: &Arc<Self>, gw: &Gateway, task: Task) -> bool {
        let Some(url) = task.callback_url.clone() else {
            return true;
        };
        let secret = gw
            .runtime()
            .tenants
            .iter()
            .find(|t| *t.name == *task.tenant)
            .and_then(|t| t.callback_secret());
        let mut attempts = task.callback.as_ref().map_or(0, |c| c.attempts);
        let body = {
            let mut v = self.view(gw, &task);
            if let Some(o) = v.as_object_mut() {
                o.remove("callback");
            }
            v.to_string()
        };
        let stop = gw.stopped_token();
        while attempts < self.cfg.callback_attempts {
            let outcome = match &secret {
                None => Err(Failure::Failed(
                    "the tenant has no callback secret configured".to_string(),
                )),
                Some(secret) => {
                    let ts = unix_ms() / 1000;
                    let Some(sig) = sign(secret, ts, &body) else {
                        tracing::error!("task {}: the callback key was refused", task.id);
                        return true;
                    };
                    post_callback(gw, &url, &task.id, ts, &sig, &body, &self.cfg).await
                }
            };
            attempts += 1;
            let ok = outcome.is_ok();
            gw.metrics()
                .task_callbacks
                .get_or_create(&crate::metrics::StateLabel {
                    state: if ok { "delivered" } else { "failed" }.into(),
                })
                .inc();
            // A refused destination stays refused: trying it again only waits longer.
            let refused = matches!(outcome, Err(Failure::Refused));
            let give_up =
                ok || refused || attempts >= self.cfg.callback_attempts || secret.is_none();
            let last = outcome.err().map(Failure::into_message);
            self.record_attempt(&task.id, attempts, ok, give_up, last)
                .await;
            if give_up {
                return true;
            }
            let cap = self
                .cfg
                .callback_backoff_ms
                .saturating_mul(1u64 << (attempts - 1).min(16))
                .min(60_000);
            let wait = Duration::from_millis(rand::random::<u64>() % (cap + 1));
            tokio::select! {
                _ = stop.cancelled() => return false,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        true
    }

    /// Stores the outcome of a callback attempt with its task.
    async fn record_attempt(
        &self,
        id: &str,
        attempts: u32,
        ok: bool,
        give_up: bool,
        last: Option<String>,
    ) {
        let r = self
            .store
            .update(
                id,
                Box::new(move |t| {
                    let c = t.callback.get_or_insert_with(CallbackState::default);
                    c.attempts = attempts;
                    c.delivered = ok;
                    c.done = give_up;
                    c.last_error.clone_from(&last);
                    true
                }),
            )
            .await;
        if let Err(e) = r {
            tracing::error!("task {id}: {e}");
        }
    }
}

/// HMAC-SHA256 of `{ts}.{body}` under the tenant's secret, hex (`None` only if the HMAC
/// refused the key, which it does for no length).
fn sign(secret: &str, ts: u64, body: &str) -> Option<String> {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).ok()?;
    mac.update(format!("{ts}.").as_bytes());
    mac.update(body.as_bytes());
    Some(hex::encode(mac.finalize().into_bytes()))
}

/// What a callback attempt's failure stores as `last_error` when the destination was
/// refused: the same words whatever the address would have answered, so the field cannot be
/// used to probe the gateway's network.
const REFUSED_BY_POLICY: &str = "refused by policy";

/// Why a callback attempt failed.
enum Failure {
    /// The egress policy refuses the destination (or its URL cannot name one): final.
    Refused,
    /// Anything else (no answer, an error status, no connection): tried again, with backoff.
    Failed(String),
}

impl Failure {
    /// What is stored as the attempt's `last_error`.
    fn into_message(self) -> String {
        match self {
            Failure::Refused => REFUSED_BY_POLICY.to_string(),
            Failure::Failed(m) => m,
        }
    }
}

/// Largest response head read from a receiver; its body is never read.
const MAX_RECEIVER_HEAD: usize = 16 * 1024;

async fn post_callback(
    gw: &Gateway,
    url: &str,
    id: &str,
    ts: u64,
    sig: &str,
    body: &str,
    cfg: &TasksConfig,
) -> Result<(), Failure> {
    let timeout = Duration::from_millis(cfg.callback_timeout_ms);
    let uri: http::Uri = url.parse().map_err(|_| Failure::Refused)?;
    let (Some(host), Some(authority)) = (uri.host(), uri.authority()) else {
        return Err(Failure::Refused);
    };
    if uri.scheme_str() != Some("http") {
        return Err(Failure::Refused);
    }
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = uri.port_u16().unwrap_or(80);
    let policy =
        EgressPolicy::new(&gw.config().tasks.callback_allow).map_err(|_| Failure::Refused)?;
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let req = http::Request::post(path)
        .header(http::header::HOST, authority.as_str())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("x-levee-task-id", id)
        .header("x-levee-timestamp", ts.to_string())
        .header("x-levee-signature", format!("sha256={sig}"))
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .map_err(|e| Failure::Failed(format!("bad callback request: {e}")))?;
    let attempt = async {
        let addr = resolve_permitted(&policy, &host, port).await?;
        send_pinned(addr, req).await.map_err(Failure::Failed)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Err(_) => Err(Failure::Failed(format!(
            "no answer within {} ms",
            cfg.callback_timeout_ms
        ))),
        Ok(Err(e)) => Err(e),
        Ok(Ok(s)) if s.is_success() => Ok(()),
        Ok(Ok(s)) if s.is_redirection() => Err(Failure::Failed(format!(
            "the receiver answered {s}; redirects are not followed"
        ))),
        Ok(Ok(s)) => Err(Failure::Failed(format!("the receiver answered {s}"))),
    }
}

/// Resolves `host` once and judges every address it names: one refused address refuses
/// the callback (a name that resolves to a public and a private address is not let
/// through half the time). The address returned is the one connected to.
async fn resolve_permitted(
    policy: &EgressPolicy,
    host: &str,
    port: u16,
) -> Result<std::net::SocketAddr, Failure> {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|_| Failure::Failed("the receiver's host name does not resolve".to_string()))?
        .collect();
    if addrs.is_empty() || addrs.iter().any(|a| !policy.permits(host, a.ip())) {
        return Err(Failure::Refused);
    }
    Ok(addrs[0])
}

/// One HTTP/1.1 exchange on a connection of its own to `addr` (no pool, no redirects, a
/// bounded response head, the body never read).
async fn send_pinned(
    addr: std::net::SocketAddr,
    req: http::Request<http_body_util::Full<Bytes>>,
) -> Result<http::StatusCode, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|_| "could not connect to the receiver".to_string())?;
    let (mut send, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_RECEIVER_HEAD)
        .handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|_| "could not connect to the receiver".to_string())?;
    let conn = tokio::spawn(conn);
    let r = send.send_request(req).await;
    conn.abort();
    r.map(|r| r.status())
        .map_err(|_| "the receiver did not answer with HTTP".to_string())
}
