//! Admit and dispatch: the fleet-wide rates in the shared store (when there is one), then
//! levee-policy's one admission path in the model's lane — limits, the lane's watermark,
//! fair share, KV budget, predicted wait — waiting in the lane's fair queue if it must;
//! then the backend it was placed on.

use super::classify::Classified;
use super::Seat;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::lane::{self, Admitted, QueueSpot};
use crate::metrics::ReasonLabels;
use crate::runtime::Tenant;
use crate::upstream::Backend;
use levee_policy::{AdmissionRequest, Key};
use std::sync::Arc;
use std::time::Duration;

/// The admit phase. Its locals are shaped for a queued request, which holds this future for
/// its whole wait: the admission request and the lane's decision are temporaries, gone
/// before the wait.
pub(super) async fn admit(
    gw: &Arc<Gateway>,
    tenant: &Tenant,
    seat: &Seat,
    c: &Classified,
    spot: Option<&QueueSpot>,
) -> Result<Admitted, GatewayError> {
    gw.scaling().arrival(&c.target.name);
    // Fleet-wide rates first (a refusal here costs the local state nothing); the charge
    // comes back if the local admission then refuses.
    let scopes = gw
        .shared()
        .and_then(|_| gw.runtime().shared_scopes.get(&tenant.name).cloned());
    let charge = match (gw.shared(), scopes) {
        (Some(shared), Some(scopes)) => {
            // The take runs to its end on a task of its own: when the client leaves while
            // the store decides, the charge the store made still arrives, and dropping it
            // refunds it (dropping a take in flight would leave it charged for good).
            let shared = shared.clone();
            let tokens = request(tenant, seat, c).tokens();
            tokio::spawn(async move { shared.take(&scopes, tokens).await })
                .await
                .map_err(|e| GatewayError::internal(format!("shared limit decision: {e}")))??
                .map(Box::new)
        }
        _ => None,
    };
    let waiting = gw.metrics().queued_wait(&tenant.name);
    // The decision is a temporary of this statement, not a local kept across the wait.
    let wait = match lane::decide(
        &c.lane,
        &tenant.limits,
        &seat.tier,
        request(tenant, seat, c),
        spot,
    ) {
        lane::Decision::Now(r) => return with_charge(r, charge, waiting),
        lane::Decision::Queued(w) => w,
    };
    // Only a queued request gets waiting state (boxed: it is this future's largest part).
    let admitted = Box::pin(wait.wait(&c.lane, spot)).await;
    with_charge(admitted, charge, waiting)
}

/// The admission with the fleet-wide charge it carries (given back if it was refused).
fn with_charge(
    admitted: Result<Admitted, GatewayError>,
    charge: Option<Box<crate::shared::Charge>>,
    waiting: crate::metrics::QueuedWait,
) -> Result<Admitted, GatewayError> {
    waiting.done();
    let mut admitted = admitted?;
    admitted.attach(charge);
    Ok(admitted)
}

/// What levee-policy's admission is asked.
fn request(tenant: &Tenant, seat: &Seat, c: &Classified) -> AdmissionRequest<Key> {
    AdmissionRequest {
        tenant: tenant.name.clone(),
        model: c.target.name.clone(),
        tier: levee_policy::Tier(seat.priority),
        prompt_tokens: c.prompt_tokens,
        completion_tokens: u64::from(c.max_tokens) * u64::from(c.parsed.choices),
        max_wait: None,
        session: c.session,
        answered_at_end: !c.parsed.stream,
    }
}

/// Counts an admitted request and the degradation measures applied to it.
pub(super) fn count_admitted(gw: &Gateway, tenant: &Tenant, seat: &Seat, c: &Classified) {
    gw.metrics().admitted_for(&tenant.metrics, &seat.tier);
    for d in &c.degraded {
        let measure = d.split('=').next().unwrap_or("degraded").to_string();
        gw.metrics()
            .degraded
            .get_or_create(&ReasonLabels {
                tier: seat.tier.clone(),
                reason: measure,
            })
            .inc();
    }
}

/// The dispatch phase: the backend the admission placed the request on.
pub(super) fn dispatch(
    admitted: Admitted,
    c: &Classified,
) -> Result<(Admitted, Arc<Backend>), GatewayError> {
    match admitted.backend() {
        Some(b) => Ok((admitted, b)),
        // Its backend was removed by a reload between the decision and now.
        None => Err(GatewayError::no_healthy_backend(
            &c.target.name,
            Duration::from_secs(1),
        )),
    }
}
