//! A hash map with a hard cap on its size, for per-key limiter state.
//!
//! When an insert would pass the cap, one sweep drops every idle entry (one whose state is
//! the same as a fresh one, so nothing is lost) and, if that is not enough, the entries with
//! the least outstanding debt until the map is at 3/4 of its cap. The sweep is O(n) but frees
//! at least n/4 slots, so inserts stay amortised O(1) and a flood of new keys cannot grow
//! memory past the cap. Evicting a key that still had debt gives it a fresh bucket; that is
//! the price of bounded memory, and the global limits still hold. Pinned entries (state that
//! live permits still refer to) are never evicted; they are bounded by the permits.

use crate::clock::Timestamp;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

/// Limiter state that can say whether it is idle and how much debt it carries.
pub(crate) trait Evictable {
    /// True if the state equals a freshly created one at `now`.
    fn is_idle(&self, now: Timestamp) -> bool;
    /// How far from idle it is at `now` (any monotone measure; larger = keep longer).
    fn debt(&self, now: Timestamp) -> u128;
    /// True if the entry must not be evicted at all.
    fn pinned(&self) -> bool {
        false
    }
}

#[derive(Debug, Clone)]
pub(crate) struct BoundedMap<K, V, S = RandomState> {
    map: HashMap<K, V, S>,
    cap: usize,
    evicted: u64,
}

impl<K: Hash + Eq + Clone, V: Evictable, S: BuildHasher + Default> BoundedMap<K, V, S> {
    pub(crate) fn new(cap: usize) -> Self {
        BoundedMap {
            map: HashMap::with_hasher(S::default()),
            cap: cap.max(1),
            evicted: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    #[inline]
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.map.get(key)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(key)
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        self.map.remove(key)
    }

    /// Inserts a new entry for an absent `key` (sweeping first if at the cap). Callers look
    /// the key up with `get_mut` first and call this only on a miss.
    pub(crate) fn insert_new(&mut self, key: &K, now: Timestamp, value: V) -> &mut V {
        if self.map.len() >= self.cap && !self.map.contains_key(key) {
            self.sweep(now);
        }
        self.map.entry(key.clone()).or_insert(value)
    }

    /// Drops idle entries; returns how many.
    pub(crate) fn evict_idle(&mut self, now: Timestamp) -> usize {
        let before = self.map.len();
        self.map.retain(|_, v| v.pinned() || !v.is_idle(now));
        let n = before - self.map.len();
        self.evicted += n as u64;
        n
    }

    fn sweep(&mut self, now: Timestamp) {
        self.evict_idle(now);
        let target = self.cap - self.cap / 4;
        if self.map.len() < target.max(1) {
            return;
        }
        // Keep the `keep` entries with the most debt; pinned entries always stay.
        let mut debts: Vec<u128> = self
            .map
            .values()
            .filter(|v| !v.pinned())
            .map(|v| v.debt(now))
            .collect();
        let pinned = self.map.len() - debts.len();
        let keep = target.saturating_sub(1).saturating_sub(pinned);
        if debts.len() <= keep {
            return;
        }
        let drop_count = debts.len() - keep;
        let (_, threshold, _) = debts.select_nth_unstable(drop_count - 1);
        let threshold = *threshold;
        let before = self.map.len();
        self.map
            .retain(|_, v| v.pinned() || v.debt(now) > threshold);
        self.evicted += (before - self.map.len()) as u64;
    }
}
