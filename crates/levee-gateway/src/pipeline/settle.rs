//! Settle: everything an admitted request must give back or report when it ends —
//! exactly once, when its answer ends or its client goes away: the backend's slot and the
//! reconciled charges, outlier ejection, breaker and latency samples, metrics, the span and
//! the request log line.

use super::forward::eject_if_due;
use super::record_end;
use crate::error::ErrorCode;
use crate::gateway::Gateway;
use crate::lane::Admitted;
use crate::lane::Lane;
use crate::proxy::{Outcome, Settle};
use crate::request_log::{ms, RequestId, RequestLine};
use crate::runtime::Tenant;
use crate::upstream::Backend;
use levee_policy::{Completion, Key, Outcome as BreakerOutcome, OverBudget};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug_span, Span};

/// Settle: everything an admitted request must give back or report when it ends.
pub(super) struct RequestSettle {
    pub gw: Arc<Gateway>,
    pub queued: Duration,
    pub sent_at: Instant,
    pub admitted: Option<Admitted>,
    pub backend: Arc<Backend>,
    pub tenant: Arc<Tenant>,
    pub model: Key,
    pub lane: Arc<Lane>,
    pub prompt_estimate: u64,
    pub prompt_kind: levee_policy::TextKind,
    pub outlier: crate::config::OutlierConfig,
    /// The outcome already went to outlier ejection (see `proxy_phase`).
    pub judged: bool,
    pub request: Option<Arc<RequestId>>,
    /// The share of requests whose line goes to the request log (`observe.request_log_sample`).
    pub log_sample: f64,
    /// The request's span: it ends when this is dropped, at the end of `settle`.
    pub span: Span,
}

impl Settle for RequestSettle {
    fn grows_at(&self) -> Option<u64> {
        self.admitted.as_ref()?.grows_at()
    }

    fn grow(&mut self, generated: u64) -> Result<Option<u64>, OverBudget> {
        self.admitted
            .as_mut()
            .map_or(Ok(None), |a| a.grow(generated))
    }

    fn hold_whole(&mut self) -> Result<(), OverBudget> {
        self.admitted.as_mut().map_or(Ok(()), Admitted::hold_whole)
    }

    fn taken_signal(&self) -> Option<Arc<Notify>> {
        self.admitted.as_ref()?.taken_signal()
    }

    fn settle(mut self: Box<Self>, outcome: Outcome) {
        let _settling = debug_span!(parent: &self.span, "settle").entered();
        let now = self.gw.now();
        let verdict = outcome.verdict(self.backend.is_routable(), &self.outlier);
        if !self.judged {
            eject_if_due(&self.gw, &self.lane, &self.backend, verdict, &self.outlier);
        }
        let breaker_outcome = verdict.breaker_outcome();
        if let Some(code) = outcome.stream_cut {
            self.gw
                .metrics()
                .stream_cut(&self.backend.id, code.as_str());
        }
        let failed = breaker_outcome == BreakerOutcome::BackendFailure;
        let in_flight = self
            .lane
            .view(|l| l.in_flight_of(&self.backend.key))
            .unwrap_or(0);
        self.backend
            .adaptive_sample(outcome.ttft, failed, in_flight);
        self.observe_latency(&outcome);
        if let Some(a) = self.admitted.take() {
            a.complete(Completion {
                outcome: breaker_outcome,
                actual_tokens: actual_tokens(&outcome),
                generated: generated(&outcome),
            });
        }
        self.record_usage(&outcome, now);
        let label = outcome_label(&outcome);
        self.gw
            .metrics()
            .request_for(&self.tenant.metrics, &self.tenant.name, &self.model, label);
        record_end(&self.span, label, outcome.status);
        self.gw.scaling().completion(&self.model);
        self.record_times(&outcome, label);
    }
}

/// The answer's completion tokens, to learn what streams hold at first: the backend's count
/// of a whole answer, or those read of a stream cut for want of KV room (at least that
/// many); nothing of an answer cut short otherwise (a client gone early says nothing of how
/// long answers run).
fn generated(o: &Outcome) -> Option<u64> {
    match (o.usage, o.stream_cut) {
        (Some(u), _) => Some(u.completion_tokens),
        (None, Some(ErrorCode::StreamKvBudget)) => o.generated,
        _ => None,
    }
}

/// Tokens to reconcile the estimate with: the backend's usage; none for an answer that
/// produced nothing (an error head, or no answer at all); the estimate stays charged for a
/// stream cut after its first token reached the client (it was generated).
fn actual_tokens(o: &Outcome) -> Option<u64> {
    match o.usage {
        Some(u) => Some(u.total()),
        None if o.status >= 400 || o.status == 0 => Some(0),
        None if o.transport_error && o.ttft.is_none() => Some(0),
        None => None,
    }
}

/// The prompt tokens the engine really prefilled, in levee's estimate's units: a warm prefix
/// (the engine's `cached_tokens`) was skipped, so its fast first token says nothing about
/// the prefill speed of a cold prompt that long.
fn prefilled(estimate: u64, o: &Outcome) -> u64 {
    match o.usage {
        Some(u) if u.prompt_tokens > 0 && u.cached_tokens() > 0 => {
            let cold = (u.prompt_tokens - u.cached_tokens()) as f64 / u.prompt_tokens as f64;
            (estimate as f64 * cold).round() as u64
        }
        _ => estimate,
    }
}

/// How the request ended, as the `outcome` label of `levee_requests_total`.
fn outcome_label(o: &Outcome) -> &'static str {
    if let Some(code) = o.stream_cut {
        code.as_str()
    } else if o.client_gone {
        "client_gone"
    } else if o.transport_error {
        "upstream_error"
    } else if o.status >= 500 {
        "upstream_5xx"
    } else if o.status >= 400 {
        "upstream_4xx"
    } else {
        "ok"
    }
}

/// The time per output token after the first of a streamed answer of `completion` tokens
/// whose first came `ttft` after sending and whose last `total` after; `None` with fewer
/// than two.
fn per_token(ttft: Duration, total: Duration, completion: u64) -> Option<Duration> {
    let steps = u32::try_from(completion.checked_sub(1)?).ok()?;
    (steps > 0).then(|| total.saturating_sub(ttft) / steps)
}

impl RequestSettle {
    /// A successful answer's time to first token and time per output token, where levee saw
    /// the engine's first token (a stream), go to its backend's latency fit; the error of
    /// the time to first token predicted at dispatch goes to `levee_ttft_prediction_ratio`.
    fn observe_latency(&self, outcome: &Outcome) {
        let (Some(a), Some(ttft)) = (&self.admitted, outcome.engine_ttft) else {
            return;
        };
        if !(200..300).contains(&outcome.status) || outcome.client_gone {
            return;
        }
        let completion = outcome.usage.map_or(0, |u| u.completion_tokens);
        let tpot = per_token(ttft, self.sent_at.elapsed(), completion);
        if let Some(p) = a.observe(ttft, tpot).filter(|p| !p.is_zero()) {
            let label = crate::metrics::BackendLabel {
                backend: self.backend.id.clone(),
            };
            self.gw
                .metrics()
                .ttft_prediction
                .get_or_create(&label)
                .observe(ttft.as_secs_f64() / p.as_secs_f64());
        }
    }

    /// Token counts, the prompt estimate's error, time to first token and the prefill fit.
    fn record_usage(&self, outcome: &Outcome, now: levee_policy::Timestamp) {
        let m = self.gw.metrics();
        if let Some(u) = outcome.usage {
            m.tokens_for(
                &self.tenant.metrics,
                &self.tenant.name,
                u.prompt_tokens,
                u.completion_tokens,
            );
            let series = &self.lane.series;
            if u.prompt_tokens > 0 {
                let ratio = self.prompt_estimate as f64 / u.prompt_tokens as f64;
                m.estimate_ratio_for(series, &self.model, ratio);
                let kind = self.prompt_kind;
                let factor =
                    self.lane
                        .note_prompt_count(kind, self.prompt_estimate, u.prompt_tokens);
                m.correction_for(series, &self.model, kind, factor);
            }
            if u.cached_tokens() > 0 {
                m.cached_tokens_for(series, &self.model, u.cached_tokens());
            }
        }
        if let Some(t) = outcome.ttft {
            m.ttft_for(&self.tenant.metrics, &self.tenant.tier, t.as_secs_f64());
            self.lane.note_ttft(now, t);
        }
        if let Some(t) = outcome.engine_ttft {
            if (200..300).contains(&outcome.status) {
                self.lane
                    .note_prefill(prefilled(self.prompt_estimate, outcome), t);
            }
        }
    }

    /// The request's durations in metrics and its request log line.
    fn record_times(&self, outcome: &Outcome, label: &str) {
        let times = crate::metrics::RequestTimes {
            queued: self.queued,
            ttft: outcome.ttft.map(|t| self.queued + t),
            total: self.queued + self.sent_at.elapsed(),
            abandoned: outcome.client_gone,
        };
        self.gw.metrics().request_times(
            &self.tenant.metrics,
            &self.model,
            &self.tenant.name,
            &self.tenant.tier,
            &times,
        );
        if let Some(id) = &self.request {
            RequestLine {
                request_id: id.as_str(),
                tenant: &self.tenant.name,
                tier: &self.tenant.tier,
                model: &self.model,
                backend: Some(&self.backend.id),
                client: id.peer,
                outcome: label,
                status: outcome.status,
                code: outcome.stream_cut.map(ErrorCode::as_str),
                queue_ms: Some(ms(times.queued)),
                ttft_ms: times.ttft.map(ms),
                duration_ms: ms(times.total),
                prompt_tokens: outcome.usage.map(|u| u.prompt_tokens),
                completion_tokens: outcome.usage.map(|u| u.completion_tokens),
            }
            .emit(id.seq, self.log_sample);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::{PromptTokensDetails, Usage};
    use std::time::Duration;

    #[test]
    fn time_per_token_is_the_rest_of_the_answer_over_the_tokens_after_the_first() {
        let ms = Duration::from_millis;
        assert_eq!(per_token(ms(100), ms(1_100), 11), Some(ms(100)));
        assert_eq!(per_token(ms(100), ms(1_100), 1), None);
        assert_eq!(per_token(ms(100), ms(1_100), 0), None);
        // A clock that reads the end before the first token: no negative time.
        assert_eq!(per_token(ms(100), ms(50), 3), Some(ms(0)));
    }

    #[test]
    fn a_warm_prefix_is_not_counted_as_prefilled() {
        let with = |cached: Option<u64>| Outcome {
            usage: Some(Usage {
                prompt_tokens: 1000,
                completion_tokens: 10,
                total_tokens: 1010,
                prompt_tokens_details: cached.map(|c| PromptTokensDetails { cached_tokens: c }),
            }),
            ..Outcome::default()
        };
        // levee estimated 1100 tokens; the engine found 800 of its 1000 in its cache.
        assert_eq!(prefilled(1100, &with(Some(800))), 220);
        assert_eq!(prefilled(1100, &with(None)), 1100);
        assert_eq!(prefilled(1100, &with(Some(0))), 1100);
        // A report past the prompt is clamped: nothing was prefilled.
        assert_eq!(prefilled(1100, &with(Some(5000))), 0);
        assert_eq!(prefilled(1100, &Outcome::default()), 1100);
    }

    #[test]
    fn cached_tokens_are_read_from_the_usage() {
        let u: Usage = serde_json::from_str(
            r#"{"prompt_tokens":50,"completion_tokens":5,"total_tokens":55,
                "prompt_tokens_details":{"cached_tokens":32}}"#,
        )
        .unwrap();
        assert_eq!(u.cached_tokens(), 32);
        let plain: Usage = serde_json::from_str(r#"{"prompt_tokens":50}"#).unwrap();
        assert_eq!(plain.cached_tokens(), 0);
    }

    /// Issue 22: a client that cuts its streams does not get them free. A stream cut after
    /// its first token keeps its estimate charged; only an answer that produced nothing is
    /// reconciled to 0, and a reported usage always wins.
    #[test]
    fn a_stream_cut_after_its_first_token_keeps_its_estimate() {
        let cut = Outcome {
            status: 200,
            ttft: Some(Duration::from_millis(30)),
            client_gone: true,
            ..Outcome::default()
        };
        assert_eq!(actual_tokens(&cut), None, "client left mid-stream");
        let broken = Outcome {
            transport_error: true,
            stream_cut: Some(ErrorCode::StreamBroken),
            ..cut
        };
        assert_eq!(actual_tokens(&broken), None, "backend broke off mid-stream");
        let before_first_byte = Outcome {
            status: 200,
            transport_error: true,
            ..Outcome::default()
        };
        assert_eq!(actual_tokens(&before_first_byte), Some(0));
        let error_head = Outcome {
            status: 500,
            ..Outcome::default()
        };
        assert_eq!(actual_tokens(&error_head), Some(0));
        let reported = Outcome {
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 5,
                total_tokens: 0,
                prompt_tokens_details: None,
            }),
            ..cut
        };
        assert_eq!(actual_tokens(&reported), Some(15));
    }

    /// What a stream's hold learns from (`kv.grow_streams`): the backend's count whenever it
    /// sent one, the tokens read of a stream cut for want of room (it ran at least that
    /// long), and nothing of a stream its client or its backend cut short.
    #[test]
    fn answer_lengths_are_learned_from_usage_or_from_a_stream_cut_for_room() {
        let read = Outcome {
            status: 200,
            ttft: Some(Duration::from_millis(30)),
            generated: Some(300),
            ..Outcome::default()
        };
        let for_room = Outcome {
            stream_cut: Some(ErrorCode::StreamKvBudget),
            ..read
        };
        assert_eq!(generated(&for_room), Some(300));
        let gone = Outcome {
            client_gone: true,
            ..read
        };
        assert_eq!(generated(&gone), None, "the client left early");
        let broken = Outcome {
            stream_cut: Some(ErrorCode::StreamBroken),
            transport_error: true,
            ..read
        };
        assert_eq!(generated(&broken), None, "the backend broke off");
        let whole = Outcome {
            usage: serde_json::from_str(r#"{"prompt_tokens":5,"completion_tokens":42}"#).ok(),
            ..gone
        };
        assert_eq!(generated(&whole), Some(42), "a reported usage wins");
    }
}
