//! Concurrency limits with RAII permits. Lock-free (an atomic counter behind an `Arc`), so a
//! permit can be dropped on any thread without the caller's lock.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug)]
struct Inner {
    limit: AtomicUsize,
    in_use: AtomicUsize,
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
            }),
        }
    }

    /// Takes a permit if one is free.
    #[inline]
    pub fn try_acquire(&self) -> Result<Permit, Saturated> {
        let limit = self.inner.limit.load(Ordering::Relaxed);
        let mut cur = self.inner.in_use.load(Ordering::Relaxed);
        loop {
            if cur >= limit {
                return Err(Saturated { limit, in_use: cur });
            }
            match self.inner.in_use.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(Permit {
                        inner: Arc::clone(&self.inner),
                    })
                }
                Err(actual) => cur = actual,
            }
        }
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

    /// Permits held now.
    pub fn in_use(&self) -> usize {
        self.inner.in_use.load(Ordering::Relaxed)
    }

    /// Permits free now.
    pub fn available(&self) -> usize {
        self.limit().saturating_sub(self.in_use())
    }
}

/// A held slot; dropping it frees the slot.
#[derive(Debug)]
#[must_use = "dropping a permit releases it at once"]
pub struct Permit {
    inner: Arc<Inner>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.inner.in_use.fetch_sub(1, Ordering::AcqRel);
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
