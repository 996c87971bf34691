//! Fault injection: a JSON body POSTed to a URL at a time. Named actions build the call
//! to the simulated engine's admin endpoint; `post` is the generic form for anything else.

use crate::exchange::HttpClient;
use crate::scenario::{Fault, FaultAction};
use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use std::time::Duration;

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

/// The admin path and body of a named action, in the simulated engine's admin API
/// (`docs/engine.md`): `crash` → `/admin/crash`, `hang` → `/admin/hang`, `slow` and
/// `errors` → `/admin/faults` with `added_latency_ms` / `error_rate`, `recover` →
/// `/admin/clear` (clears latency, errors and hang; a crashed engine comes back by itself
/// after its restart time).
fn engine_call(fault: &Fault) -> (&'static str, serde_json::Map<String, serde_json::Value>) {
    let mut body = serde_json::Map::new();
    let path = match fault.action {
        FaultAction::Crash => "/admin/crash",
        FaultAction::Hang => "/admin/hang",
        FaultAction::Slow => {
            body.insert(
                "added_latency_ms".into(),
                fault.latency_ms.unwrap_or(100.0).into(),
            );
            "/admin/faults"
        }
        FaultAction::Errors => {
            body.insert("error_rate".into(), fault.error_rate.unwrap_or(0.5).into());
            "/admin/faults"
        }
        FaultAction::Recover | FaultAction::Post => "/admin/clear",
    };
    (path, body)
}

/// The URL and body a fault posts. The URL is `None` when a named action names an engine
/// the target does not list and the fault gives no `url`.
pub fn request_for(fault: &Fault, engine_admin: &[String]) -> (Option<String>, serde_json::Value) {
    if fault.action == FaultAction::Post {
        return (
            fault.url.clone(),
            fault.body.clone().unwrap_or(serde_json::Value::Null),
        );
    }
    let (path, mut body) = engine_call(fault);
    let url = fault.url.clone().or_else(|| {
        engine_admin
            .get(fault.engine)
            .map(|base| format!("{}{path}", base.trim_end_matches('/')))
    });
    if let Some(serde_json::Value::Object(extra)) = &fault.body {
        for (k, v) in extra {
            body.insert(k.clone(), v.clone());
        }
    }
    (url, serde_json::Value::Object(body))
}

/// The schedule with each timed fault (`duration_s`) followed by its `recover`, sorted by
/// time. A crash has no duration: the engine restarts by itself.
pub fn expand(faults: &[Fault]) -> Vec<Fault> {
    let mut out = Vec::new();
    for f in faults {
        out.push(f.clone());
        if let (Some(d), FaultAction::Hang | FaultAction::Slow | FaultAction::Errors) =
            (f.duration_s, f.action)
        {
            out.push(Fault {
                at_s: f.at_s + d.max(0.0),
                action: FaultAction::Recover,
                url: None,
                body: None,
                duration_s: None,
                ..f.clone()
            });
        }
    }
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
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
