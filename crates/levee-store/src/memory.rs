//! The in-memory store: levee-policy's limiters behind one lock.

use crate::limits::{
    Decision, Figures, LimitStore, Limited, ScopeLimits, Settlement, Slice, SliceDecision,
    StoreError,
};
use levee_policy::{Clock, Gcra, Refused, TokenBucket};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

#[derive(Debug, Default)]
struct State {
    requests: Option<Gcra>,
    tokens: Option<TokenBucket>,
    /// Leases held (this process is their only holder: they end with it).
    leases: HashSet<Box<str>>,
}

impl State {
    /// Makes the limiters match `scope`'s quotas, keeping debt when a quota changes (the
    /// gateway changes them when the number of live replicas changes).
    fn align(&mut self, scope: &ScopeLimits) {
        match (scope.requests, self.requests.as_mut()) {
            (Some(q), Some(g)) if g.quota() != q => g.set_quota(q),
            (Some(_), Some(_)) => {}
            (q, _) => self.requests = q.map(Gcra::new),
        }
        match (scope.tokens, self.tokens.as_mut()) {
            (Some(q), Some(b)) if b.quota() != q => b.set_quota(q),
            (Some(_), Some(_)) => {}
            (q, _) => self.tokens = q.map(TokenBucket::new),
        }
    }
}

/// Limits kept in this process. State is per scope id; scopes come from configuration, so
/// the map is bounded by the number of configured tenants.
#[derive(Debug)]
pub struct MemoryStore<C> {
    clock: C,
    states: Mutex<HashMap<Arc<str>, State>>,
}

impl<C: Clock> MemoryStore<C> {
    /// An empty store on `clock`.
    pub fn new(clock: C) -> Self {
        MemoryStore {
            clock,
            states: Mutex::new(HashMap::new()),
        }
    }

    /// Decides at once (the store never waits on anything).
    pub fn take_now(&self, scopes: &[ScopeLimits], tokens: u64, lease: &str) -> Decision {
        let now = self.clock.now();
        let mut states = self.states.lock();
        for s in scopes {
            states.entry(s.id.clone()).or_default().align(s);
        }
        // Take scope by scope; on a refusal, give back what earlier scopes took. Both
        // limiters' give-backs restore their state exactly (time already passed aside).
        let mut taken: Vec<(usize, bool, bool)> = Vec::with_capacity(scopes.len());
        let mut refusal = None;
        for (i, s) in scopes.iter().enumerate() {
            let Some(st) = states.get_mut(&s.id) else {
                continue;
            };
            if s.concurrency.is_some_and(|c| st.leases.len() as u64 >= c) {
                refusal = Some((i, Limited::Concurrency, std::time::Duration::ZERO));
                break;
            }
            let mut r = false;
            if let Some(g) = st.requests.as_mut() {
                if let Err(e) = g.check(now) {
                    refusal = Some((i, Limited::Requests, e.retry_after));
                    break;
                }
                r = true;
            }
            if let Some(b) = st.tokens.as_mut() {
                if let Err(e) = b.reserve(tokens, now) {
                    if r {
                        if let Some(g) = st.requests.as_mut() {
                            g.refund(now);
                        }
                    }
                    refusal = Some(match e {
                        Refused::NotUntil { retry_after } => (i, Limited::Tokens, retry_after),
                        Refused::TooLarge { capacity } => {
                            (i, Limited::TooLarge { capacity }, std::time::Duration::ZERO)
                        }
                    });
                    break;
                }
                taken.push((i, r, true));
                continue;
            }
            taken.push((i, r, false));
        }
        if let Some((scope, limit, retry_after)) = refusal {
            for (i, r, t) in taken {
                if let Some(st) = states.get_mut(&scopes[i].id) {
                    if r {
                        if let Some(g) = st.requests.as_mut() {
                            g.refund(now);
                        }
                    }
                    if t {
                        if let Some(b) = st.tokens.as_mut() {
                            b.reconcile(tokens, 0, now);
                        }
                    }
                }
            }
            return Decision::Refused {
                scope,
                limit,
                retry_after,
            };
        }
        for s in scopes.iter().filter(|s| s.concurrency.is_some()) {
            if let Some(st) = states.get_mut(&s.id) {
                st.leases.insert(lease.into());
            }
        }
        let figures = scopes
            .last()
            .and_then(|s| states.get(&s.id))
            .map(|st| Figures {
                requests: st.requests.as_ref().map(|g| g.info(now)),
                tokens: st.tokens.as_ref().map(|b| b.info(now)),
            })
            .unwrap_or_default();
        Decision::Admitted(figures)
    }

    /// Grants a slice at once (see [`LimitStore::take_slice`]).
    pub fn take_slice_now(
        &self,
        scopes: &[ScopeLimits],
        requests: u64,
        max_tokens: u64,
        min_tokens: u64,
    ) -> SliceDecision {
        let now = self.clock.now();
        let mut states = self.states.lock();
        let (mut g_r, mut g_t) = (requests.max(1), max_tokens.max(min_tokens));
        for (i, s) in scopes.iter().enumerate() {
            let st = states.entry(s.id.clone()).or_default();
            st.align(s);
            if let Some(g) = st.requests.as_ref() {
                let avail = g.info(now).remaining;
                if avail < 1 {
                    let mut probe = g.clone();
                    let retry_after = probe.check(now).err().map(|e| e.retry_after);
                    return SliceDecision::Refused {
                        scope: i,
                        limit: Limited::Requests,
                        retry_after: retry_after.unwrap_or_default(),
                    };
                }
                g_r = g_r.min(avail);
            }
            if let Some(b) = st.tokens.as_ref() {
                let capacity = b.quota().capacity();
                if min_tokens > capacity {
                    return SliceDecision::Refused {
                        scope: i,
                        limit: Limited::TooLarge { capacity },
                        retry_after: std::time::Duration::ZERO,
                    };
                }
                // As in `take`: a bucket in debt refuses even a request of zero tokens.
                if let Err(Refused::NotUntil { retry_after }) = b.clone().reserve(min_tokens, now) {
                    return SliceDecision::Refused {
                        scope: i,
                        limit: Limited::Tokens,
                        retry_after,
                    };
                }
                g_t = g_t.min(b.available(now));
            }
        }
        for s in scopes {
            if let Some(st) = states.get_mut(&s.id) {
                if let Some(g) = st.requests.as_mut() {
                    for _ in 0..g_r {
                        let _ = g.check(now);
                    }
                }
                if let Some(b) = st.tokens.as_mut() {
                    let _ = b.reserve(g_t, now);
                }
            }
        }
        let figures = scopes
            .last()
            .and_then(|s| states.get(&s.id))
            .map(|st| Figures {
                requests: st.requests.as_ref().map(|g| g.info(now)),
                tokens: st.tokens.as_ref().map(|b| b.info(now)),
            })
            .unwrap_or_default();
        SliceDecision::Granted(Slice {
            requests: g_r,
            tokens: g_t,
            figures,
        })
    }

    /// Settles at once.
    pub fn settle_now(&self, scopes: &[ScopeLimits], s: Settlement, lease: &str) {
        let now = self.clock.now();
        let mut states = self.states.lock();
        for scope in scopes {
            let Some(st) = states.get_mut(&scope.id) else {
                continue;
            };
            st.align(scope);
            st.leases.remove(lease);
            if let Some(g) = st.requests.as_mut() {
                for _ in 0..s.give_back_requests {
                    g.refund(now);
                }
            }
            if s.reserved != s.actual {
                if let Some(b) = st.tokens.as_mut() {
                    b.reconcile(s.reserved, s.actual, now);
                }
            }
        }
    }
}

impl<C: Clock> LimitStore for MemoryStore<C> {
    async fn take(
        &self,
        scopes: &[ScopeLimits],
        tokens: u64,
        lease: &str,
    ) -> Result<Decision, StoreError> {
        Ok(self.take_now(scopes, tokens, lease))
    }

    async fn take_slice(
        &self,
        scopes: &[ScopeLimits],
        requests: u64,
        max_tokens: u64,
        min_tokens: u64,
    ) -> Result<SliceDecision, StoreError> {
        Ok(self.take_slice_now(scopes, requests, max_tokens, min_tokens))
    }

    async fn settle(
        &self,
        scopes: &[ScopeLimits],
        s: Settlement,
        lease: &str,
    ) -> Result<(), StoreError> {
        self.settle_now(scopes, s, lease);
        Ok(())
    }
}
