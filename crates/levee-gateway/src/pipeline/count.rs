//! Count: a long prompt counted by the engine itself before admission
//! (`[models.exact_count]`), so that its KV reservation is the engine's figure rather than
//! levee's estimate. Short prompts, prompts the engine's endpoint cannot take (token ids,
//! batches), and counts that fail or pass their time keep the corrected estimate.

use super::classify::Classified;
use crate::gateway::Gateway;
use tracing::Instrument;

/// The count phase: replaces `c.prompt_tokens` by a backend's count when the model asks for
/// exact counts and the corrected estimate is long enough.
pub(super) async fn exact(gw: &Gateway, c: &mut Classified) {
    let Some(x) = c.target.exact_count else {
        return;
    };
    if c.prompt_tokens < x.min_prompt_tokens {
        return;
    }
    let Some(prompt) = c.parsed.prompt_source() else {
        return;
    };
    // Any routable backend of the model counts as the one admission will pick would.
    let Some(b) = c.lane.backends().into_iter().find(|b| b.is_routable()) else {
        return;
    };
    // Boxed: the exchange's state is over a kilobyte, and unboxed it would widen the future
    // of every request, queued ones included, whether it is counted or not. A span only
    // when the backend is asked: most requests never are.
    let count = Box::pin(
        tokio::time::timeout(x.timeout, b.count_prompt(gw.client(), &prompt))
            .instrument(tracing::debug_span!("count")),
    );
    let outcome = match count.await {
        Ok(Ok(n)) => {
            c.prompt_tokens = n;
            "counted"
        }
        Ok(Err(e)) => {
            tracing::debug!(backend = %b.key, "exact count failed, the estimate stands: {e:#}");
            "failed"
        }
        Err(_) => "timed_out",
    };
    gw.metrics().exact_count(&c.target.name, outcome);
}
