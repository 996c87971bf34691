//! The response cache in a request's path (see [`crate::response_cache`] for what is kept):
//! the key is taken at classify for a tenant that opted in; a stored answer is served
//! instead of admission while the requested model's lane is degraded to `cache.from_level`
//! or past it, and instead of a refusal when none of its backends can serve; a backend's
//! undegraded 200 answer to a non-streamed request is kept.

use super::classify::Classified;
use super::{record_end, RequestCtx};
use crate::gateway::Gateway;
use crate::response_cache::{as_stream, key_of, CacheKey};
use crate::runtime::Tenant;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode};

/// The request's cache key, if its tenant opted in (`ctx`) and the request is
/// deterministic. Taken at classify, while the body is still at hand.
pub(super) fn key(gw: &Gateway, ctx: &RequestCtx, model: &str, body: &[u8]) -> Option<CacheKey> {
    if !ctx.response_cache || gw.config().cache.max_bytes == 0 {
        return None;
    }
    key_of(&ctx.tenant, model, body).ok()
}

/// The stored answer, when the requested model's lane is degraded to `cache.from_level`
/// or past it.
pub(super) fn when_degraded(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    ctx: &RequestCtx,
) -> Option<Response> {
    let key = c.cache?;
    let from = gw.config().cache.from_level;
    if from == 0 || c.level < from {
        return None;
    }
    reply(gw, tenant, c, ctx, &key)
}

/// The stored answer for `key`, marked, counted and recorded; `None` on a miss.
pub(super) fn reply(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    ctx: &RequestCtx,
    key: &CacheKey,
) -> Option<Response> {
    let body = gw.response_cache().get(key, gw.now())?;
    let mut resp = if c.parsed.stream {
        let sse = as_stream(&body)?;
        ([(http::header::CONTENT_TYPE, "text/event-stream")], sse).into_response()
    } else {
        ([(http::header::CONTENT_TYPE, "application/json")], body).into_response()
    };
    resp.headers_mut()
        .insert("x-levee-degraded", HeaderValue::from_static("cache"));
    gw.metrics()
        .degraded
        .get_or_create(&crate::metrics::ReasonLabels {
            tier: tenant.tier.clone(),
            reason: "cache".into(),
        })
        .inc();
    gw.metrics().request(&tenant.name, &c.target.name, "cache");
    record_end(&ctx.span, "cache", StatusCode::OK.as_u16());
    Some(resp)
}

/// Keeps a backend's answer for `c`, if it has a key and was not degraded (a capped or
/// fallback-model answer is not what the request asked for).
pub(super) fn keeper(gw: &std::sync::Arc<Gateway>, c: &Classified) -> impl FnOnce(&Bytes) {
    let key = c.cache.filter(|_| c.degraded.is_empty());
    let gw = gw.clone();
    move |body: &Bytes| {
        if let Some(k) = key {
            gw.response_cache().put(k, body.clone(), gw.now());
        }
    }
}
