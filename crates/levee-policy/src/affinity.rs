//! Session affinity with bounded load.
//!
//! A warm KV cache is the cheapest capacity an inference engine has: the turns of one
//! conversation resend its history, and an engine that served the previous turn still holds
//! that prefix and skips most of its prefill. So a request that carries a session key
//! prefers the backend that served its session last — but only while that backend is not
//! overloaded relative to its peers, or a popular session would pile onto one engine. The
//! rule is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
//! "Consistent Hashing with Bounded Loads", SODA 2018), weighted by capacity:
//!
//! a backend of capacity `c` out of the lane's total `C`, with `L` requests in flight on the
//! lane, may take a preferred request only while its own count after taking it stays within
//! `⌈(1 + ε) · (L + 1) · c / C⌉`. Otherwise the request goes where load alone sends it (the
//! least filled backend with room).
//!
//! Bound (what [`choose`] guarantees, and what the property tests check): the backend it
//! returns is above the bound after placement only when no backend with room is within it.
//! The least-loaded backend always is (its count is at most `⌊L · c / C⌋`), so with equal
//! capacities no request is placed above `(1 + ε) ×` the mean while another backend has room.
//!
//! [`SessionMap`] remembers which backend served each session, in bounded memory.

use crate::fasthash::FastState;
use std::collections::HashMap;
use std::sync::Arc;

/// One backend as the choice sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Requests in flight there.
    pub load: u64,
    /// Its capacity in requests (at least 1 counts).
    pub capacity: u64,
    /// Whether it can take this request now (routable, breaker closed, within its caps).
    pub room: bool,
}

/// The most requests a backend of `capacity` (of the lane's `total_capacity`) may hold after
/// taking one more, with `total_load` in flight on the lane before it: `⌈(1 + ε)·(L + 1)·c / C⌉`.
pub fn load_bound(capacity: u64, total_load: u64, total_capacity: u64, epsilon: f64) -> u64 {
    let c = capacity.max(1) as f64;
    let total = total_capacity.max(1) as f64;
    let eps = if epsilon.is_finite() {
        epsilon.max(0.0)
    } else {
        0.0
    };
    let bound = ((1.0 + eps) * (total_load as f64 + 1.0) * c / total).ceil();
    // At least one request each: an idle backend can always take one.
    (bound as u64).max(1)
}

/// Whether candidate `i` of `cands` may take one more request under the bound.
pub fn within_bound(cands: &[Candidate], i: usize, epsilon: f64) -> bool {
    let Some(c) = cands.get(i) else {
        return false;
    };
    let total_load = cands.iter().map(|c| c.load).sum();
    let total_capacity = cands.iter().map(|c| c.capacity.max(1)).sum();
    c.load < load_bound(c.capacity, total_load, total_capacity, epsilon)
}

/// The backend a request goes to: `preferred` if it has room and stays within the load bound,
/// else the candidate with room of least `load / capacity` (ties to the lower index).
pub fn choose(cands: &[Candidate], preferred: Option<usize>, epsilon: f64) -> Option<usize> {
    if let Some(p) = preferred {
        if cands.get(p).is_some_and(|c| c.room) && within_bound(cands, p, epsilon) {
            return Some(p);
        }
    }
    least_loaded(cands)
}

/// The candidate with room of least `load / capacity` (ties to the lower index).
pub fn least_loaded(cands: &[Candidate]) -> Option<usize> {
    cands
        .iter()
        .enumerate()
        .filter(|(_, c)| c.room)
        .min_by(|(ia, a), (ib, b)| {
            // Compare a.load / a.cap with b.load / b.cap without division.
            let l = u128::from(a.load) * u128::from(b.capacity.max(1));
            let r = u128::from(b.load) * u128::from(a.capacity.max(1));
            l.cmp(&r).then(ia.cmp(ib))
        })
        .map(|(i, _)| i)
}

/// A session's key: the hash of a client's session header, or of its conversation's leading
/// messages.
pub type SessionKey = u64;

/// Which backend served each session last, for at most `capacity` sessions (about: the
/// newest half is kept in full, the older half until the newer one fills). Both look-up and
/// update are O(1); a forgotten session only loses its preference.
#[derive(Debug)]
pub struct SessionMap {
    capacity: usize,
    current: HashMap<SessionKey, Arc<str>, FastState>,
    previous: HashMap<SessionKey, Arc<str>, FastState>,
}

impl SessionMap {
    /// An empty map remembering at most `capacity` sessions.
    pub fn new(capacity: usize) -> Self {
        SessionMap {
            capacity,
            current: HashMap::default(),
            previous: HashMap::default(),
        }
    }

    /// The backend that served `session` last, if remembered.
    pub fn get(&self, session: SessionKey) -> Option<&Arc<str>> {
        self.current
            .get(&session)
            .or_else(|| self.previous.get(&session))
    }

    /// Records that `backend` served `session`.
    pub fn record(&mut self, session: SessionKey, backend: Arc<str>) {
        let half = (self.capacity / 2).max(1);
        if self.capacity == 0 {
            return;
        }
        if self.current.len() >= half && !self.current.contains_key(&session) {
            self.previous = std::mem::take(&mut self.current);
        }
        self.previous.remove(&session);
        self.current.insert(session, backend);
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// True if none is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Changes the bound; the map shrinks at its next turnover.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
        if capacity == 0 {
            self.current.clear();
            self.previous.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(load: u64, room: bool) -> Candidate {
        Candidate {
            load,
            capacity: 4,
            room,
        }
    }

    #[test]
    fn preferred_within_bound_keeps_its_session() {
        // Mean after placement (9 + 1) / 3 = 3.33; (1.25) × that, rounded up = 5.
        let cands = [c(4, true), c(3, true), c(2, true)];
        assert_eq!(choose(&cands, Some(0), 0.25), Some(0));
        // At ε = 0.1 the bound is ⌈3.67⌉ = 4: backend 0 would hold 5, so least loaded.
        assert_eq!(choose(&cands, Some(0), 0.1), Some(2));
        // No preference: least loaded.
        assert_eq!(choose(&cands, None, 0.25), Some(2));
        // Preferred without room: least loaded.
        let full = [c(1, false), c(3, true), c(2, true)];
        assert_eq!(choose(&full, Some(0), 10.0), Some(2));
    }

    #[test]
    fn capacity_weights_the_bound() {
        let cands = [
            Candidate {
                load: 6,
                capacity: 8,
                room: true,
            },
            Candidate {
                load: 1,
                capacity: 2,
                room: true,
            },
        ];
        // L + 1 = 8; backend 0 has 8 / 10 of the capacity: bound ⌈1.1 · 8 · 0.8⌉ = 8.
        assert!(within_bound(&cands, 0, 0.1));
        // Backend 1: ⌈1.1 · 8 · 0.2⌉ = 2.
        assert!(within_bound(&cands, 1, 0.1));
        assert_eq!(least_loaded(&cands), Some(1));
    }

    #[test]
    fn session_map_is_bounded_and_keeps_the_newest() {
        let mut m = SessionMap::new(4);
        let b: Arc<str> = Arc::from("b");
        for s in 0..100u64 {
            m.record(s, b.clone());
            assert!(m.len() <= 4);
        }
        assert!(m.get(99).is_some());
        assert!(m.get(98).is_some());
        assert!(m.get(0).is_none());
        // Refreshing an old entry keeps it.
        m.record(98, Arc::from("c"));
        assert_eq!(m.get(98).map(|s| &**s), Some("c"));
    }
}
