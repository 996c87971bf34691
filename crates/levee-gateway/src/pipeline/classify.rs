//! Classify: parse the body, resolve the model and its lane, apply the lane's degradation
//! (shed, fallback model, `max_tokens` cap), count the prompt, inject the default completion
//! budget, and refuse at once what can never fit the model's context.

use super::{RequestCtx, Seat};
use crate::client_request::ClientRequest;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::lane::Lane;
use crate::metrics::TierLabel;
use crate::runtime::{Model, Runtime};
use std::sync::Arc;
use std::time::Duration;

/// What classification learned about a request: everything admission and the upstream call
/// need, with the prompt text already counted and dropped.
pub(super) struct Classified {
    pub parsed: ClientRequest,
    /// The model served (the requested one, or its fallback under degradation).
    pub target: Arc<Model>,
    pub lane: Arc<Lane>,
    /// Prompt tokens reserved: the estimate corrected by what the engine counted lately.
    pub prompt_tokens: u64,
    /// levee's own estimate of the prompt.
    pub prompt_estimate: u64,
    /// What the prompt's text is mostly made of (its correction is learned per kind).
    pub prompt_kind: levee_policy::TextKind,
    /// The completion budget per choice after degradation and the default.
    pub max_tokens: u32,
    /// What to write as `max_tokens` upstream, when it differs from what the client sent.
    pub cap: Option<u32>,
    /// Measures applied (`max_tokens=256`, `fallback=small`).
    pub degraded: Vec<String>,
    /// Its session (header, else conversation opening) when affinity is on.
    pub session: Option<u64>,
    /// The requested model's degradation level.
    pub level: u8,
    /// Its response-cache key, when its tenant opted in and it is deterministic.
    pub cache: Option<crate::response_cache::CacheKey>,
    /// The request's id, for its log line.
    pub request: Option<std::sync::Arc<crate::request_log::RequestId>>,
    /// The request's span, kept until it settles.
    pub span: tracing::Span,
}

/// The longest context of `model`: configured, else the smallest any backend reported.
fn max_context(model: &Model, lane: &Lane) -> Option<u64> {
    model.max_context_tokens.or_else(|| {
        lane.backends()
            .iter()
            .filter_map(|b| b.learned().max_context)
            .min()
    })
}

/// The classify phase.
pub(super) fn classify(
    gw: &Gateway,
    rt: &Runtime,
    seat: &Seat,
    body: &[u8],
    ctx: &mut RequestCtx,
) -> Result<Classified, GatewayError> {
    // The request keeps a copy of the body in an allocation of its own: the body read from
    // hyper is a view into the connection's read buffer, and a queued request holding it
    // would keep that buffer alive (the caller drops its view once classified).
    let affinity = rt.cfg.affinity.enabled;
    let (parsed, prompt) = ClientRequest::parse_keyed(body, affinity)?;
    let Some(model) = rt.models.get(&parsed.model).cloned() else {
        // Never a metric label from an unvalidated client string.
        ctx.model = "unknown".into();
        return Err(GatewayError::unknown_model(&parsed.model));
    };
    ctx.model = model.name.clone();
    let mut degraded: Vec<String> = Vec::new();
    let Some(mut lane) = gw.lane(&model.name) else {
        return Err(GatewayError::unknown_model(&model.name));
    };
    let decision = lane.degradation();
    shed(gw, seat, &model.name, &decision)?;
    let mut target = model.clone();
    if decision.use_fallback {
        if let Some(fb) = model.fallback.as_ref().and_then(|f| rt.models.get(f)) {
            target = fb.clone();
            degraded.push(format!("fallback={}", fb.name));
            let Some(fb_lane) = gw.lane(&fb.name) else {
                return Err(GatewayError::unknown_model(&fb.name));
            };
            lane = fb_lane;
        }
    }
    ctx.lane = Some(lane.clone());
    let (prompt_estimate, prompt_kind) = target.counter.measure(&prompt);
    drop(prompt);
    let prompt_tokens = lane.prompt_reservation(prompt_kind, prompt_estimate);
    let context = max_context(&target, &lane);
    // The context check refuses only what the engine would refuse too: by the least it is
    // likely to count, never by an estimate (or a correction) that errs high.
    let floor = lane.prompt_floor(prompt_estimate);
    let max_tokens = completion_budget(&parsed, &target, (floor, prompt_estimate), context)?;
    let max_tokens = match decision.max_tokens_cap {
        Some(cap) if max_tokens > cap => {
            degraded.push(format!("max_tokens={cap}"));
            cap
        }
        _ => max_tokens,
    };
    let cap = (parsed.max_tokens != Some(max_tokens)).then_some(max_tokens);
    let session = ctx.session.or(parsed.conversation);
    let cache = super::cached::key(gw, ctx, &parsed.model, body);
    Ok(Classified {
        session,
        level: decision.level,
        cache,
        parsed,
        target,
        lane,
        prompt_tokens,
        prompt_estimate,
        prompt_kind,
        max_tokens,
        cap,
        degraded,
        request: ctx.request.clone(),
        span: ctx.span.clone(),
    })
}

/// Moves a classified request to its model's `fallback` model (for a tier whose predicted
/// TTFT misses degrade): that model's lane and its reservation of the same prompt, marked
/// `slo_fallback=NAME` (header `x-levee-degraded`, and
/// `levee_degraded_total{reason="slo_fallback"}` once admitted). `false`, and nothing
/// changed, when the model has no fallback or the request does not fit its context.
pub(super) fn retarget(gw: &Gateway, rt: &Runtime, c: &mut Classified) -> bool {
    let Some(fb) = c.target.fallback.as_ref().and_then(|f| rt.models.get(f)) else {
        return false;
    };
    let Some(lane) = gw.lane(&fb.name) else {
        return false;
    };
    let floor = lane.prompt_floor(c.prompt_estimate);
    let asked = floor + u64::from(c.max_tokens);
    if max_context(fb, &lane).is_some_and(|ctx| asked > ctx) {
        return false;
    }
    c.prompt_tokens = lane.prompt_reservation(c.prompt_kind, c.prompt_estimate);
    c.degraded.push(format!("slo_fallback={}", fb.name));
    c.target = fb.clone();
    c.lane = lane;
    true
}

/// The lane's degradation sheds this seat's tier: refused at once, counted.
fn shed(
    gw: &Gateway,
    seat: &Seat,
    model: &str,
    decision: &crate::degrade::DegradeDecision,
) -> Result<(), GatewayError> {
    match decision.shed_from_priority {
        Some(p) if seat.sheddable && seat.priority >= p => {
            gw.metrics()
                .shed
                .get_or_create(&TierLabel {
                    tier: seat.tier.clone(),
                })
                .inc();
            Err(GatewayError::capacity_overload(
                &format!(
                    "degradation level {} of model {model:?} sheds tier {}",
                    decision.level, seat.tier
                ),
                Duration::from_secs(1),
            ))
        }
        _ => Ok(()),
    }
}

/// The completion budget per choice: the client's `max_tokens`, or the model's default
/// (never more than the context leaves); a request that can never fit is refused.
///
/// `prompt` is (the least the engine is likely to count, levee's estimate): the refusal
/// goes by the first, the room an injected default leaves by the second.
fn completion_budget(
    parsed: &ClientRequest,
    target: &Model,
    (floor, prompt_tokens): (u64, u64),
    context: Option<u64>,
) -> Result<u32, GatewayError> {
    let requested = parsed.max_tokens;
    let Some(ctx) = context else {
        return Ok(requested.unwrap_or(target.default_max_tokens));
    };
    let asked = floor + u64::from(requested.unwrap_or(0));
    if floor >= ctx || (requested.is_some() && asked > ctx) {
        return Err(GatewayError::context_length_exceeded(format!(
            "this model's maximum context length is {ctx} tokens; this request asks for \
             at least {asked} (prompt ≥ {floor}{}); shorten the prompt or lower \
             max_tokens",
            requested
                .map(|m| format!(" + max_tokens {m}"))
                .unwrap_or_default()
        )));
    }
    // An injected default never asks for more than the context leaves.
    let room = u32::try_from(ctx.saturating_sub(prompt_tokens)).unwrap_or(u32::MAX);
    Ok(requested
        .unwrap_or(target.default_max_tokens)
        .min(room.max(1)))
}
