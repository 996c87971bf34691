//! The task routes: `POST /v1/tasks`, `GET /v1/tasks`, `GET /v1/tasks/{id}`,
//! `DELETE /v1/tasks/{id}`.

use super::{err_object, store_failed, unix_ms, Tasks, Waiting};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::pipeline::{read_body, tenant_of};
use crate::runtime::Tenant;
use crate::task_store::{Inserted, Status, Task};
use axum::extract::{ConnectInfo, Path, Query, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// What the task routes need: the gateway, and the task service when tasks are enabled.
#[derive(Clone)]
struct TaskApi {
    gw: Arc<Gateway>,
    tasks: Option<Arc<Tasks>>,
}

/// The task routes (answering 404 `not_found` with a reason when tasks are not enabled).
pub(crate) fn router(gw: Arc<Gateway>, tasks: Option<Arc<Tasks>>) -> Router {
    Router::new()
        .route("/v1/tasks", post(submit).get(list))
        .route("/v1/tasks/{id}", get(show).delete(cancel))
        .with_state(TaskApi { gw, tasks })
}

/// The caller's tenant, after the per-IP guard (polls are requests like any other).
fn caller(
    gw: &Gateway,
    peer: SocketAddr,
    headers: &HeaderMap,
) -> Result<Arc<Tenant>, GatewayError> {
    if let Err(wait) = gw.check_ip(peer.ip()) {
        return Err(GatewayError::rate_limited(
            "per-IP request rate",
            wait,
            crate::error::RateInfo::default(),
        ));
    }
    tenant_of(gw, headers)
}

fn tasks_of(api: &TaskApi) -> Result<&Arc<Tasks>, GatewayError> {
    api.tasks.as_ref().ok_or_else(|| {
        GatewayError::new(
            crate::error::ErrorCode::NotFound,
            "async tasks are not enabled on this gateway (tasks.enabled)",
        )
    })
}

async fn owned(tasks: &Arc<Tasks>, tenant: &Tenant, id: &str) -> Result<Task, GatewayError> {
    match tasks.store.get(id).await.map_err(store_failed)? {
        Some(t) if *t.tenant == *tenant.name => Ok(t),
        _ => Err(GatewayError::task_not_found(id)),
    }
}

/// `POST /v1/tasks`: a chat or completion body, plus an optional `callback_url`.
async fn submit(
    State(api): State<TaskApi>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> Response {
    submit_inner(&api, peer, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn submit_inner(
    api: &TaskApi,
    peer: SocketAddr,
    req: Request,
) -> Result<Response, GatewayError> {
    let (gw, tasks) = (&api.gw, tasks_of(api)?);
    if gw.is_draining() {
        return Err(GatewayError::draining(Duration::from_millis(
            gw.config().server.drain_retry_after_ms,
        )));
    }
    let tenant = caller(gw, peer, req.headers())?;
    let rt = gw.runtime();
    let timeout = Duration::from_millis(rt.cfg.server.body_read_timeout_ms);
    let body = read_body(req, rt.cfg.server.max_body_bytes, timeout).await?;
    let mut v: Value = serde_json::from_slice(&body)
        .map_err(|e| GatewayError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Some(obj) = v.as_object_mut() else {
        return Err(GatewayError::bad_request(
            "the body must be a JSON object (a chat or completion request)",
        ));
    };
    let callback_url = callback_of(obj, &tenant)?;
    let (endpoint, model) = endpoint_of(obj)?;
    if !rt.models.contains_key(&model) {
        return Err(GatewayError::unknown_model(&model));
    }
    let seq = tasks.store.next_seq().await.map_err(store_failed)?;
    let id = format!("task_{seq:016x}{:08x}", rand::random::<u32>());
    let task = Task {
        id: id.clone(),
        seq,
        tenant: tenant.name.to_string(),
        endpoint: endpoint.into(),
        model,
        body: v.to_string(),
        callback_url,
        status: Status::Queued,
        created_ms: unix_ms(),
        started_ms: None,
        finished_ms: None,
        attempts: 0,
        result: None,
        error: None,
        callback: None,
    };
    store(tasks, &task, &tenant).await?;
    let view = enqueued(gw, tasks, &task, &tenant).await;
    let mut resp = (StatusCode::ACCEPTED, axum::Json(view)).into_response();
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&format!("/v1/tasks/{id}")) {
        h.insert(http::header::LOCATION, v);
    }
    h.insert(
        http::header::RETRY_AFTER,
        HeaderValue::from(crate::error::retry_after_secs(Duration::from_millis(
            tasks.cfg.poll_interval_ms,
        ))),
    );
    Ok(resp)
}

/// The task's `callback_url`, taken out of its body: an `http://` URL with a host, for a
/// tenant whose callbacks can be signed.
fn callback_of(
    obj: &mut Map<String, Value>,
    tenant: &Tenant,
) -> Result<Option<String>, GatewayError> {
    let u = match obj.remove("callback_url") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(u)) => u,
        Some(_) => {
            return Err(GatewayError::bad_request("callback_url must be a string")
                .with_param("callback_url"))
        }
    };
    let ok = u
        .parse::<http::Uri>()
        .is_ok_and(|p| p.scheme_str() == Some("http") && p.authority().is_some());
    if !ok {
        return Err(GatewayError::bad_request(format!(
            "callback_url {u:?} must be an http:// URL with a host"
        ))
        .with_param("callback_url"));
    }
    if tenant.callback_secret().is_none() {
        return Err(GatewayError::bad_request(
            "this tenant has no callback secret (tenants[].callback_secret_env), so \
             its callbacks could not be signed; poll GET /v1/tasks/{id} instead",
        )
        .with_param("callback_url"));
    }
    Ok(Some(u))
}

/// The route a task body is for (chat or completion) and its model.
fn endpoint_of(obj: &Map<String, Value>) -> Result<(&'static str, String), GatewayError> {
    if obj.get("stream").and_then(Value::as_bool) == Some(true) {
        return Err(GatewayError::bad_request(
            "tasks are not streamed: leave out \"stream\" (the result is stored whole)",
        )
        .with_param("stream"));
    }
    let endpoint = if obj.contains_key("messages") {
        "/v1/chat/completions"
    } else if obj.contains_key("prompt") {
        "/v1/completions"
    } else {
        return Err(GatewayError::bad_request(
            "a task body is a chat request (with \"messages\") or a completion request (with \
             \"prompt\")",
        ));
    };
    let Some(model) = obj.get("model").and_then(Value::as_str).map(str::to_string) else {
        return Err(GatewayError::bad_request("\"model\" must be a string").with_param("model"));
    };
    Ok((endpoint, model))
}

/// Stores a new task, within the tenant's limit of open tasks.
async fn store(tasks: &Tasks, task: &Task, tenant: &Tenant) -> Result<(), GatewayError> {
    let max_open = tasks.cfg.max_queued_per_tenant;
    match tasks
        .store
        .insert(task, max_open)
        .await
        .map_err(store_failed)?
    {
        Inserted::Stored => Ok(()),
        Inserted::Full { open } => {
            // When one of them is likely to finish.
            let wait = tasks
                .band
                .lock()
                .service_s
                .map_or(Duration::from_millis(tasks.cfg.poll_interval_ms), |s| {
                    Duration::from_secs_f64(s.max(0.001))
                });
            Err(GatewayError::rate_limited(
                &format!(
                    "tenant {} has {open} tasks queued or running, its limit \
                     (tasks.max_queued_per_tenant); wait for one to finish",
                    tenant.name
                ),
                wait,
                crate::error::RateInfo::default(),
            ))
        }
    }
}

/// Puts a stored task in line (the fleet's queue, or this replica's band) and returns its
/// view with its place.
async fn enqueued(gw: &Gateway, tasks: &Tasks, task: &Task, tenant: &Tenant) -> Value {
    let view = if tasks.store.shared() {
        // Any replica with room may take it: wake this one's reader at once.
        tasks.pull.notify_one();
        let ahead = match tasks.store.ahead(&task.id).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("task {}: its place in the queue: {e}", task.id);
                None
            }
        };
        tasks.view_at(gw, task, ahead)
    } else {
        tasks.band.lock().enqueue(
            task.seq,
            Waiting {
                id: task.id.clone(),
                tenant: Arc::from(&*tenant.name),
                model: Arc::from(task.model.as_str()),
                not_before: None,
            },
        );
        tasks.view(gw, task)
    };
    tasks.wake.notify_one();
    view
}

/// `GET /v1/tasks/{id}`.
async fn show(
    State(api): State<TaskApi>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (gw, tasks) = (&api.gw, tasks_of(&api)?);
        let tenant = caller(gw, peer, &headers)?;
        let t = owned(tasks, &tenant, &id).await?;
        let ahead = tasks.fleet_ahead(&t).await;
        Ok::<_, GatewayError>(axum::Json(tasks.view_at(gw, &t, ahead)).into_response())
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// `DELETE /v1/tasks/{id}`: cancels a queued or running task (a running one is cut
/// upstream: at once when this replica runs it, at the running replica's next renewal tick
/// on a shared queue); a finished task is answered as it is.
async fn cancel(
    State(api): State<TaskApi>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (gw, tasks) = (&api.gw, tasks_of(&api)?);
        let tenant = caller(gw, peer, &headers)?;
        // Only the owner may cancel.
        owned(tasks, &tenant, &id).await?;
        let e = err_object("task_cancelled", "the task was cancelled by its tenant");
        let t = match tasks
            .finish(gw, &id, Status::Cancelled, None, Some(e))
            .await
        {
            Some(done) => {
                tasks.withdraw(&id);
                done
            }
            None => owned(tasks, &tenant, &id).await?,
        };
        Ok::<_, GatewayError>(axum::Json(tasks.view(gw, &t)).into_response())
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// Query of `GET /v1/tasks`.
#[derive(Debug, serde::Deserialize)]
struct ListQuery {
    limit: Option<usize>,
    after: Option<String>,
}

/// `GET /v1/tasks?limit=N&after=ID`: the caller's tasks, oldest first.
async fn list(
    State(api): State<TaskApi>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Query(q): Query<ListQuery>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (gw, tasks) = (&api.gw, tasks_of(&api)?);
        let tenant = caller(gw, peer, &headers)?;
        let limit = q.limit.unwrap_or(20).clamp(1, 100);
        let mut page = tasks
            .store
            .list(&tenant.name, q.after.as_deref(), limit + 1)
            .await
            .map_err(store_failed)?;
        let has_more = page.len() > limit;
        page.truncate(limit);
        let data: Vec<Value> = page.iter().map(|t| tasks.view(gw, t)).collect();
        Ok::<_, GatewayError>(
            axum::Json(json!({
                "object": "list",
                "data": data,
                "first_id": page.first().map(|t| &t.id),
                "last_id": page.last().map(|t| &t.id),
                "has_more": has_more,
            }))
            .into_response(),
        )
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}
