//! What a refused request gets instead of its refusal, where configured: the model's
//! fallback reply instead of a 503 when none of its backends can serve, and for a tier
//! whose predicted TTFT misses degrade (`slo_miss = "degrade"`) a stored answer or the
//! model's fallback model instead of 429 `slo_unattainable`.

use super::classify::{self, Classified};
use super::{record_end, RequestCtx, Seat};
use crate::config::SloMiss;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::runtime::{Runtime, Tenant};
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use levee_policy::RefusalReason;

/// What follows a refusal of admission.
pub(super) enum Next {
    /// The request's answer: a degraded one, or the refusal.
    Answer(Result<Response, GatewayError>),
    /// Moved to its model's fallback model: admit it there.
    AdmitAgain,
}

/// A refusal of admission: for a predicted TTFT miss in a tier that degrades, a stored
/// answer (its tenant opted in and one is kept), else the fallback model; otherwise as
/// [`or_error`].
pub(super) fn on_refusal(
    gw: &Gateway,
    rt: &Runtime,
    tenant: &Tenant,
    seat: &Seat,
    c: &mut Classified,
    ctx: &RequestCtx,
    e: GatewayError,
) -> Next {
    let slo_miss = e.refusal() == Some(RefusalReason::PredictedSloMiss);
    if !(slo_miss && seat.slo_miss == SloMiss::Degrade) {
        return Next::Answer(or_error(gw, tenant, c, ctx, e));
    }
    if let Some(resp) = c
        .cache
        .as_ref()
        .and_then(|key| super::cached::reply(gw, tenant, c, ctx, key))
    {
        return Next::Answer(Ok(resp));
    }
    if classify::retarget(gw, rt, c) {
        return Next::AdmitAgain;
    }
    Next::Answer(Err(e))
}

/// A refusal of admission, when it was refused because no backend can serve: the stored
/// answer to the same request if the response cache has one, else the model's fallback
/// reply if it has one; the refusal otherwise.
pub(super) fn or_error(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    ctx: &RequestCtx,
    e: GatewayError,
) -> Result<Response, GatewayError> {
    let unservable = matches!(e.refusal(), Some(RefusalReason::Unservable(_)));
    if let Some(key) = c.cache.as_ref().filter(|_| unservable) {
        if let Some(resp) = super::cached::reply(gw, tenant, c, ctx, key) {
            return Ok(resp);
        }
    }
    match (&c.target.fallback_response, unservable) {
        (Some(text), true) => {
            record_end(&ctx.span, "fallback_response", StatusCode::OK.as_u16());
            Ok(fallback_reply(gw, tenant, c, ctx.path, text, &e))
        }
        _ => Err(e),
    }
}

/// The model's canned reply when none of its backends can serve.
fn fallback_reply(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    path: &str,
    text: &str,
    e: &GatewayError,
) -> Response {
    gw.metrics()
        .degraded
        .get_or_create(&crate::metrics::ReasonLabels {
            tier: tenant.tier.clone(),
            reason: "fallback_response".into(),
        })
        .inc();
    gw.metrics()
        .request(&tenant.name, &c.target.name, "fallback_response");
    canned_response(
        path,
        &c.target.name,
        c.parsed.stream,
        text,
        e.code().as_str(),
    )
}

/// The configured fallback reply in the OpenAI shape (chat or legacy completion, streamed
/// or not).
fn canned_response(path: &str, model: &str, stream: bool, text: &str, why: &str) -> Response {
    let chat = path.ends_with("/chat/completions");
    let mut resp = if stream {
        let chunk = if chat {
            serde_json::json!({"id": "levee-fallback", "object": "chat.completion.chunk", "created": 0,
                "model": model, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})
        } else {
            serde_json::json!({"id": "levee-fallback", "object": "text_completion", "created": 0,
                "model": model, "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
        };
        let body = format!("data: {chunk}\n\ndata: [DONE]\n\n");
        ([(http::header::CONTENT_TYPE, "text/event-stream")], body).into_response()
    } else {
        let usage =
            serde_json::json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
        let body = if chat {
            serde_json::json!({"id": "levee-fallback", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": usage})
        } else {
            serde_json::json!({"id": "levee-fallback", "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}], "usage": usage})
        };
        axum::Json(body).into_response()
    };
    let h = resp.headers_mut();
    h.insert(
        "x-levee-degraded",
        HeaderValue::from_static("fallback_response"),
    );
    if let Ok(v) = HeaderValue::from_str(why) {
        h.insert("x-levee-fallback-reason", v);
    }
    resp
}
