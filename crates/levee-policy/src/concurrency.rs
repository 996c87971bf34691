//! Concurrency limits with RAII permits. Lock-free (an atomic counter behind an `Arc`), so a
//! permit can be dropped on any thread without the caller's lock.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

#[derive(Debug)]
struct Inner {
    limit: AtomicUsize,
    in_use: AtomicUsize,
    /// The pools that hold permits of this limit in reserve ([`PermitPool`]), to take their
    /// spares back before refusing.
    pools: Mutex<Vec<Weak<PoolInner>>>,
}

/// A limit on how many things run at once. Cloning shares the limit.
#[derive(Debug, Clone)]
pub struct ConcurrencyLimit {
    inner: Arc<Inner>,
}

/// Refused: the limit is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saturated {
    /// The limit.
    pub limit: usize,
    /// Permits held when refused.
    pub in_use: usize,
}

impl ConcurrencyLimit {
    /// A limit of `limit` permits.
    pub fn new(limit: usize) -> Self {
        ConcurrencyLimit {
            inner: Arc::new(Inner {
                limit: AtomicUsize::new(limit),
                in_use: AtomicUsize::new(0),
                pools: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Takes a permit if one is free.
    #[inline]
    pub fn try_acquire(&self) -> Result<Permit, Saturated> {
        self.inner.take_up_to(1).map(|_| Permit {
            source: Source::Limit(Arc::clone(&self.inner)),
        })
    }

    /// Changes the limit (e.g. from [`crate::AdaptiveLimit`]). Permits already held stay
    /// valid; a lower limit just refuses new ones until enough are dropped.
    pub fn set_limit(&self, limit: usize) {
        self.inner.limit.store(limit, Ordering::Relaxed);
    }

    /// The limit.
    pub fn limit(&self) -> usize {
        self.inner.limit.load(Ordering::Relaxed)
    }

    /// Permits held now (not counting those pools keep in reserve).
    pub fn in_use(&self) -> usize {
        let spare: usize = self
            .inner
            .pools
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|p| {
                let c = p.count.lock();
                c.0 - c.1
            })
            .sum();
        self.inner
            .in_use
            .load(Ordering::Relaxed)
            .saturating_sub(spare)
    }

    /// Permits free now.
    pub fn available(&self) -> usize {
        self.limit().saturating_sub(self.in_use())
    }
}

impl Inner {
    /// Takes between 1 and `n` permits, as many as are free.
    #[inline]
    fn take_up_to(&self, n: usize) -> Result<usize, Saturated> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut cur = self.in_use.load(Ordering::Relaxed);
        loop {
            if cur >= limit {
                return Err(Saturated { limit, in_use: cur });
            }
            let take = n.min(limit - cur);
            match self.in_use.compare_exchange_weak(
                cur,
                cur + take,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(take),
                Err(actual) => cur = actual,
            }
        }
    }

    fn give_back(&self, n: usize) {
        if n > 0 {
            self.in_use.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Takes every pool's spare permits back; forgets pools that are gone.
    fn reclaim(&self) {
        let mut pools = self.pools.lock();
        pools.retain(|w| match w.upgrade() {
            Some(p) => {
                p.release_spares(0);
                true
            }
            None => false,
        });
    }
}

/// One holder's reserve of a shared [`ConcurrencyLimit`]: permits taken from it in chunks
/// and handed out one at a time from a count of the holder's own, so that holders on
/// different threads (a lane per model) do not each write the shared count for every
/// request. A pool keeps at most two chunks spare, and before the shared limit refuses
/// anybody it takes every pool's spares back: a refusal still means the limit's permits
/// are really out.
#[derive(Debug, Clone)]
pub(crate) struct PermitPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    parent: Arc<Inner>,
    chunk: usize,
    /// `(taken from the parent, handed out)`.
    count: Mutex<(usize, usize)>,
}

impl PoolInner {
    /// Returns the spares above `keep` to the parent.
    fn release_spares(&self, keep: usize) {
        self.trim(&mut self.count.lock(), keep);
    }

    fn trim(&self, (taken, out): &mut (usize, usize), keep: usize) {
        let spare = *taken - *out;
        if spare > keep {
            *taken -= spare - keep;
            self.parent.give_back(spare - keep);
        }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let c = self.count.get_mut();
        self.parent.give_back(c.0 - c.1);
    }
}

impl PermitPool {
    /// A pool of `limit`'s permits taken `chunk` at a time; `None` when a chunk would be
    /// under two permits (a small limit is shared exactly, one permit at a time).
    pub(crate) fn new(limit: &ConcurrencyLimit, chunk: usize) -> Option<Self> {
        if chunk < 2 {
            return None;
        }
        let inner = Arc::new(PoolInner {
            parent: Arc::clone(&limit.inner),
            chunk,
            count: Mutex::new((0, 0)),
        });
        let mut pools = limit.inner.pools.lock();
        // Pools replaced (after a change of limits) and gone are forgotten here too.
        pools.retain(|w| w.strong_count() > 0);
        pools.push(Arc::downgrade(&inner));
        drop(pools);
        Some(PermitPool { inner })
    }

    /// Whether this pool draws on `limit`.
    pub(crate) fn draws_on(&self, limit: &ConcurrencyLimit) -> bool {
        Arc::ptr_eq(&self.inner.parent, &limit.inner)
    }

    /// Takes a permit: from the pool's spares, else a new chunk from the shared limit, else
    /// (the limit is out) after taking every pool's spares back.
    pub(crate) fn try_acquire(&self) -> Result<Permit, Saturated> {
        let p = &self.inner;
        {
            let mut c = p.count.lock();
            if c.1 < c.0 {
                c.1 += 1;
                return Ok(self.permit());
            }
        }
        let got = match p.parent.take_up_to(p.chunk) {
            Ok(n) => n,
            Err(_) => {
                p.parent.reclaim();
                p.parent.take_up_to(1)?
            }
        };
        let mut c = p.count.lock();
        c.0 += got;
        c.1 += 1;
        Ok(self.permit())
    }

    fn permit(&self) -> Permit {
        Permit {
            source: Source::Pool(Arc::clone(&self.inner)),
        }
    }
}

/// A held slot; dropping it frees the slot.
#[derive(Debug)]
#[must_use = "dropping a permit releases it at once"]
pub struct Permit {
    source: Source,
}

#[derive(Debug)]
enum Source {
    Limit(Arc<Inner>),
    Pool(Arc<PoolInner>),
}

impl Drop for Permit {
    fn drop(&mut self) {
        match &self.source {
            Source::Limit(inner) => inner.give_back(1),
            Source::Pool(pool) => {
                let mut c = pool.count.lock();
                c.1 -= 1;
                pool.trim(&mut c, 2 * pool.chunk);
            }
        }
    }
}

/// Per-key concurrency limits (per tenant, per backend) with a default and overrides.
/// Keys without held permits are dropped when the map passes `max_keys`; keys with held
/// permits stay, and their number is bounded by the permits outstanding.
#[derive(Debug, Clone)]
pub struct KeyedConcurrency<K> {
    default: Option<usize>,
    overrides: HashMap<K, Option<usize>>,
    limits: HashMap<K, ConcurrencyLimit>,
    max_keys: usize,
}

impl<K: Hash + Eq + Clone> KeyedConcurrency<K> {
    /// Every key gets `default` (`None`: unlimited) unless overridden.
    pub fn new(default: Option<usize>, max_keys: usize) -> Self {
        KeyedConcurrency {
            default,
            overrides: HashMap::new(),
            limits: HashMap::new(),
            max_keys: max_keys.max(1),
        }
    }

    /// Sets `key`'s limit (`None`: unlimited).
    pub fn set_limit(&mut self, key: K, limit: Option<usize>) {
        match limit {
            Some(l) => {
                if let Some(c) = self.limits.get(&key) {
                    c.set_limit(l);
                }
            }
            None => {
                self.limits.remove(&key);
            }
        }
        self.overrides.insert(key, limit);
    }

    /// The limit that applies to `key`.
    pub fn limit_for(&self, key: &K) -> Option<usize> {
        match self.overrides.get(key) {
            Some(l) => *l,
            None => self.default,
        }
    }

    /// A permit for `key`; `Ok(None)` if the key is unlimited.
    #[inline]
    pub fn try_acquire(&mut self, key: &K) -> Result<Option<Permit>, Saturated> {
        if let Some(c) = self.limits.get(key) {
            return c.try_acquire().map(Some);
        }
        let Some(limit) = self.limit_for(key) else {
            return Ok(None);
        };
        if self.limits.len() >= self.max_keys {
            self.limits.retain(|_, c| c.in_use() > 0);
        }
        let c = ConcurrencyLimit::new(limit);
        let p = c.try_acquire()?;
        self.limits.insert(key.clone(), c);
        Ok(Some(p))
    }

    /// Permits held by `key`.
    pub fn in_use(&self, key: &K) -> usize {
        self.limits.get(key).map_or(0, |c| c.in_use())
    }

    /// Keys tracked.
    pub fn tracked_keys(&self) -> usize {
        self.limits.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_keeps_at_most_two_chunks_and_gives_everything_back_when_gone() {
        let limit = ConcurrencyLimit::new(100);
        let taken = || limit.inner.in_use.load(Ordering::Relaxed);
        let pool = PermitPool::new(&limit, 4).unwrap();
        let permits: Vec<_> = (0..20).map(|_| pool.try_acquire().unwrap()).collect();
        assert_eq!((taken(), limit.in_use()), (20, 20));
        drop(permits);
        assert_eq!(
            (taken(), limit.in_use()),
            (8, 0),
            "two chunks kept in reserve"
        );
        let p = pool.try_acquire().unwrap();
        assert_eq!(taken(), 8, "served from the reserve");
        drop(pool);
        assert_eq!(taken(), 8, "a permit out keeps its pool");
        drop(p);
        assert_eq!(taken(), 0);
        assert!(
            PermitPool::new(&limit, 1).is_none(),
            "a chunk of one is no pool"
        );
        let pools: Vec<_> = (0..100).map(|_| PermitPool::new(&limit, 4)).collect();
        drop(pools);
        let _last = PermitPool::new(&limit, 4);
        assert_eq!(
            limit.inner.pools.lock().len(),
            1,
            "pools gone are forgotten"
        );
    }

    #[test]
    fn permits_release_on_drop() {
        let c = ConcurrencyLimit::new(2);
        let a = c.try_acquire().unwrap();
        let _b = c.try_acquire().unwrap();
        assert_eq!(
            c.try_acquire().unwrap_err(),
            Saturated {
                limit: 2,
                in_use: 2
            }
        );
        drop(a);
        assert_eq!(c.in_use(), 1);
        assert!(c.try_acquire().is_ok());
        assert_eq!(c.in_use(), 1);
    }

    #[test]
    fn lower_limit_applies_to_new_permits() {
        let c = ConcurrencyLimit::new(3);
        let ps: Vec<_> = (0..3).map(|_| c.try_acquire().unwrap()).collect();
        c.set_limit(1);
        drop(ps);
        let _one = c.try_acquire().unwrap();
        assert!(c.try_acquire().is_err());
    }

    #[test]
    fn threads_never_exceed_limit() {
        let c = ConcurrencyLimit::new(3);
        let peak = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let c = c.clone();
                let peak = Arc::clone(&peak);
                s.spawn(move || {
                    for _ in 0..20_000 {
                        if let Ok(p) = c.try_acquire() {
                            peak.fetch_max(c.in_use(), Ordering::Relaxed);
                            drop(p);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Relaxed) <= 3);
        assert_eq!(c.in_use(), 0);
    }

    #[test]
    fn keyed_limits() {
        let mut k = KeyedConcurrency::new(Some(1), 2);
        k.set_limit("big", Some(3));
        let a = k.try_acquire(&"a").unwrap();
        assert!(a.is_some());
        assert!(k.try_acquire(&"a").is_err());
        let bigs: Vec<_> = (0..3).map(|_| k.try_acquire(&"big").unwrap()).collect();
        assert!(k.try_acquire(&"big").is_err());
        drop(bigs);
        drop(a);
        assert!(k.tracked_keys() <= 2);
    }

    #[test]
    fn keyed_memory_bounded() {
        let mut k: KeyedConcurrency<String> = KeyedConcurrency::new(Some(1), 8);
        for i in 0..1000 {
            let _ = k.try_acquire(&format!("k{i}"));
            assert!(k.tracked_keys() <= 8);
        }
    }
}
