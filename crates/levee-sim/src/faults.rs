//! Fault injection: a JSON body POSTed to a URL at a time. Named actions build the call
//! to the simulated engine's admin endpoint; `post` is the generic form for anything else.

use crate::exchange::HttpClient;
use crate::scenario::{Fault, FaultAction};
use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use std::time::Duration;

/// Path of the engine's fault endpoint under its admin base URL.
pub const ENGINE_FAULT_PATH: &str = "/admin/fault";

/// The action's name as written in TOML.
pub fn action_name(action: FaultAction) -> &'static str {
    match action {
        FaultAction::Crash => "crash",
        FaultAction::Hang => "hang",
        FaultAction::Slow => "slow",
        FaultAction::Errors => "errors",
        FaultAction::Recover => "recover",
        FaultAction::Post => "post",
    }
}

/// The URL and body a fault posts. The URL is `None` when a named action names an engine
/// the target does not list and the fault gives no `url`.
pub fn request_for(fault: &Fault, engine_admin: &[String]) -> (Option<String>, serde_json::Value) {
    let url = fault.url.clone().or_else(|| {
        engine_admin
            .get(fault.engine)
            .map(|base| format!("{}{ENGINE_FAULT_PATH}", base.trim_end_matches('/')))
    });
    if fault.action == FaultAction::Post {
        return (url, fault.body.clone().unwrap_or(serde_json::Value::Null));
    }
    let mut body = serde_json::Map::new();
    body.insert("fault".into(), action_name(fault.action).into());
    if let Some(ms) = fault.latency_ms {
        body.insert("latency_ms".into(), ms.into());
    }
    if let Some(rate) = fault.error_rate {
        body.insert("error_rate".into(), rate.into());
    }
    if let Some(d) = fault.duration_s {
        body.insert("duration_s".into(), d.into());
    }
    if let Some(serde_json::Value::Object(extra)) = &fault.body {
        for (k, v) in extra {
            body.insert(k.clone(), v.clone());
        }
    }
    (url, serde_json::Value::Object(body))
}

/// POSTs `body` as JSON and returns the status.
pub(crate) async fn post_json(
    client: &HttpClient,
    url: &str,
    body: &serde_json::Value,
) -> anyhow::Result<u16> {
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("fault URL {url:?} is not valid"))?;
    let bytes = serde_json::to_vec(body).context("cannot serialise the fault body")?;
    let request = http::Request::post(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(bytes)))?;
    let response = tokio::time::timeout(Duration::from_secs(5), client.request(request))
        .await
        .with_context(|| format!("{url} did not answer within 5 s"))?
        .with_context(|| format!("cannot reach {url}"))?;
    Ok(response.status().as_u16())
}
