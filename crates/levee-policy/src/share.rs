//! A lane's share of the gateway-wide scope.
//!
//! Every decision of every lane charges the global scope: a request and its tokens against
//! the global rates, a permit against the global concurrency. Taken one request at a time,
//! that is a write to the same few cache lines from every core for every request, and two
//! lanes deciding at once on two cores wait for those lines to move between them. So a lane
//! takes the global limits in small slices and spends them under its own lock:
//!
//! - **rates**: a slice is one millisecond of the rate ([`crate::limits::SHARE_WINDOW`]) (at most a quarter of its burst);
//!   a lane holds at most two slices unspent, and gives back what it holds above that when
//!   a request ends or is refused. Where a slice would be under two requests (or tokens),
//!   the lane takes exactly what each request needs and gives back everything it did not
//!   spend at once, so a small global rate is shared exactly as before. What a lane holds
//!   counts as spent for the other lanes: a global rate may run up to two windows' worth
//!   per lane ahead of or behind its exact value.
//! - **concurrency**: permits come from a [`PermitPool`] taking chunks of 1/256 of the
//!   limit; before the global limit refuses, every pool's spares go back, so a refusal
//!   still means the limit's permits are really out.
//!
//! A change of the global limits is seen by its generation: a share taken under the old
//! limits is given back whole and taken again.

use crate::clock::Timestamp;
use crate::concurrency::{ConcurrencyLimit, Permit, PermitPool};
use crate::limits::{Charged, LimitRefusal, ScopeLimits};
use crate::refusal::{RefusalReason, Scope};

/// Permits a pool takes at once: this share of the limit.
const POOL_CHUNK_DIVISOR: usize = 256;

/// One lane's share of the global scope. Use it under the lane's lock.
#[derive(Debug, Default)]
pub(crate) struct GlobalShare {
    held: Option<Held>,
    pool: Option<(u64, Option<PermitPool>)>,
}

/// Rates held: `None` where the rate is not limited.
#[derive(Debug)]
struct Held {
    generation: u64,
    requests: Option<u64>,
    tokens: Option<u64>,
    slice: (u64, u64),
}

impl GlobalShare {
    /// A global permit for one request (`None`: the scope does not bound concurrency).
    pub(crate) fn acquire(
        &mut self,
        global: &ScopeLimits,
    ) -> Result<Option<Permit>, RefusalReason> {
        let Some(limit) = global.bounded_concurrency() else {
            return Ok(None);
        };
        let generation = global.generation();
        let current = matches!(&self.pool, Some((g, p))
            if *g == generation && p.as_ref().is_none_or(|p| p.draws_on(limit)));
        if !current {
            let chunk = limit.limit() / POOL_CHUNK_DIVISOR;
            self.pool = Some((generation, PermitPool::new(limit, chunk)));
        }
        let permit = match self.pool.as_ref().and_then(|(_, p)| p.as_ref()) {
            Some(p) => p.try_acquire(),
            None => ConcurrencyLimit::try_acquire(limit),
        };
        permit
            .map(Some)
            .map_err(|_| RefusalReason::Concurrency(Scope::Global))
    }

    /// Makes sure the share holds one request of `tokens` tokens, taking a slice from the
    /// global rates when it does not. Refused as the global rates refuse that request.
    pub(crate) fn ensure(
        &mut self,
        global: &ScopeLimits,
        tokens: u64,
        now: Timestamp,
    ) -> Result<(), LimitRefusal> {
        if !global.is_rated() {
            self.held = None;
            return Ok(());
        }
        if self
            .held
            .as_ref()
            .is_some_and(|h| h.generation != global.generation())
        {
            self.give_back_all(global, now);
        }
        let (need_requests, need_tokens) = match &self.held {
            None => (1, tokens),
            Some(h) => (
                u64::from(h.requests.is_some_and(|r| r == 0)),
                h.tokens.map_or(0, |t| tokens.saturating_sub(t)),
            ),
        };
        if need_requests == 0 && need_tokens == 0 {
            return Ok(());
        }
        let Some(mut rates) = global.rates() else {
            return Ok(());
        };
        // Read under the lock: a change of limits happens under it too.
        let generation = global.generation();
        let taken = rates.take_share(need_requests, need_tokens, now, Scope::Global)?;
        let held = self.held.get_or_insert(Held {
            generation,
            requests: taken.requests.map(|_| 0),
            tokens: taken.tokens.map(|_| 0),
            slice: taken.slice,
        });
        held.slice = taken.slice;
        add(&mut held.requests, taken.requests);
        add(&mut held.tokens, taken.tokens);
        Ok(())
    }

    /// Spends what [`GlobalShare::ensure`] made sure of: what the global scope charged.
    pub(crate) fn spend(&mut self, tokens: u64) -> Charged {
        let Some(h) = self.held.as_mut() else {
            return (false, false);
        };
        if let Some(r) = h.requests.as_mut() {
            *r = r.saturating_sub(1);
        }
        if let Some(t) = h.tokens.as_mut() {
            *t = t.saturating_sub(tokens);
        }
        (h.requests.is_some(), h.tokens.is_some())
    }

    /// Settles one request's global charges into the share (see
    /// [`ScopeLimits::settle`]): a refunded request and unused tokens come back to it, an
    /// overrun is paid from it, and past what the share holds from the global rates.
    pub(crate) fn settle(
        &mut self,
        global: &ScopeLimits,
        charged: Charged,
        refund_request: bool,
        reserved: u64,
        actual: u64,
        now: Timestamp,
    ) {
        if charged == (false, false) {
            return;
        }
        let current = global.generation();
        let Some(h) = self.held.as_mut().filter(|h| h.generation == current) else {
            global.settle(charged, refund_request, reserved, actual, now);
            return;
        };
        if let (true, true, Some(r)) = (charged.0, refund_request, h.requests.as_mut()) {
            *r += 1;
        }
        if let (true, Some(t)) = (charged.1, h.tokens.as_mut()) {
            if actual <= reserved {
                *t += reserved - actual;
            } else {
                let over = actual - reserved;
                let rest = over.saturating_sub(*t);
                *t = t.saturating_sub(over);
                if rest > 0 {
                    global.settle((false, true), false, 0, rest, now);
                }
            }
        }
        self.trim(global, now);
    }

    /// Gives back what the share holds above two slices of each rate (all of it where the
    /// rate is shared exactly). Call it after a refusal that followed
    /// [`GlobalShare::ensure`].
    pub(crate) fn trim(&mut self, global: &ScopeLimits, now: Timestamp) {
        let Some(h) = self.held.as_mut() else {
            return;
        };
        let over = |held: Option<u64>, slice: u64| held.map_or(0, |n| n.saturating_sub(2 * slice));
        let requests = over(h.requests, h.slice.0);
        let tokens = over(h.tokens, h.slice.1);
        if requests == 0 && tokens == 0 {
            return;
        }
        if let Some(r) = h.requests.as_mut() {
            *r -= requests;
        }
        if let Some(t) = h.tokens.as_mut() {
            *t -= tokens;
        }
        if let Some(mut rates) = global.rates() {
            rates.give_back(requests, tokens, now);
        }
    }

    fn give_back_all(&mut self, global: &ScopeLimits, now: Timestamp) {
        if let Some(h) = self.held.take() {
            if let Some(mut rates) = global.rates() {
                rates.give_back(h.requests.unwrap_or(0), h.tokens.unwrap_or(0), now);
            }
        }
    }
}

fn add(held: &mut Option<u64>, taken: Option<u64>) {
    if let (Some(h), Some(t)) = (held.as_mut(), taken) {
        *h = h.saturating_add(t);
    }
}
