//! The KV cache's blocks and its prefix cache, as pure bookkeeping.
//!
//! The cache holds `capacity` blocks of [`KV_BLOCK_SIZE`] tokens. A block is either *in use*
//! (held by one or more running sequences), *cached* (left behind by a sequence that left
//! the batch, kept for a later prompt that starts with the same tokens, evicted least
//! recently released first when a block is needed), or free. Cached blocks count as free
//! for admission, as vLLM's do.
//!
//! A block is known by a hash of its 16 token ids chained with the hash of the block before
//! it ([`block_hashes`]), so equal hashes mean equal token prefixes. When a sequence leaves
//! the batch (finished, preempted, cancelled), its full blocks are registered under their
//! hashes; a new sequence whose prompt starts with registered blocks takes them instead of
//! computing them (its prefill skips those tokens). A crash wipes everything.

use crate::config::KV_BLOCK_SIZE;
use crate::tokenizer::TokenId;
use std::collections::{BTreeMap, HashMap};

/// Hashes of the full [`KV_BLOCK_SIZE`]-token blocks of `ids`, each chained to the one
/// before it (a partial last block has none).
pub fn block_hashes(ids: &[TokenId]) -> Vec<u64> {
    let mut out = Vec::with_capacity(ids.len() / KV_BLOCK_SIZE as usize);
    let mut h: u64 = 0x6b76_2d63_6163_6865;
    for block in ids.chunks_exact(KV_BLOCK_SIZE as usize) {
        for id in block {
            h ^= u64::from(*id);
            h = crate::tokens::mix(h);
        }
        out.push(h);
    }
    out
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Running sequences holding the block.
    refs: u32,
    /// Its key in the LRU list while `refs == 0`.
    stamp: u64,
}

/// Blocks in use, cached and free; the prefix cache's index.
#[derive(Debug)]
pub(crate) struct BlockPool {
    capacity: u64,
    caching: bool,
    /// Blocks held by running sequences (a cached block shared by several counts once).
    used: u64,
    /// Registered blocks by hash, in use or cached.
    entries: HashMap<u64, Entry>,
    /// Cached blocks (registered, held by no one), least recently released first.
    lru: BTreeMap<u64, u64>,
    next_stamp: u64,
}

impl BlockPool {
    /// `capacity` blocks; with `caching` false no block is ever registered.
    pub fn new(capacity: u64, caching: bool) -> Self {
        Self {
            capacity,
            caching,
            used: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    /// Blocks held by running sequences.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Cached blocks nobody holds (free for admission, kept until evicted).
    pub fn cached(&self) -> u64 {
        self.lru.len() as u64
    }

    /// Blocks a new allocation may take: free and cached.
    pub fn available(&self) -> u64 {
        self.capacity - self.used
    }

    /// How many of `hashes`, from the first, are registered.
    pub fn hits(&self, hashes: &[u64]) -> usize {
        if !self.caching {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count()
    }

    /// Blocks that taking the registered `hashes` (all hits) moves into use: those nobody
    /// holds now.
    pub fn revived(&self, hashes: &[u64]) -> u64 {
        hashes
            .iter()
            .filter(|h| self.entries.get(h).is_some_and(|e| e.refs == 0))
            .count() as u64
    }

    /// Takes the registered blocks `hits` (one more holder each) and `fresh` new blocks.
    /// The caller checked that `revived(hits) + fresh <= available()`.
    pub fn acquire(&mut self, hits: &[u64], fresh: u64) {
        for h in hits {
            if let Some(e) = self.entries.get_mut(h) {
                if e.refs == 0 {
                    self.lru.remove(&e.stamp);
                    self.used += 1;
                }
                e.refs += 1;
            }
        }
        self.allocate(fresh);
    }

    /// Takes `n` new blocks, evicting cached ones (least recently released first) to make
    /// room. The caller checked that `n <= available()`.
    pub fn allocate(&mut self, n: u64) {
        self.used += n;
        while self.used + self.lru.len() as u64 > self.capacity {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.entries.remove(&h);
        }
    }

    /// Gives back a sequence's blocks: `shared` are the registered blocks it took at
    /// admission, `computed` the hashes of its own full blocks after them, `private` how
    /// many blocks of its own it held (full and partial). Its full blocks are registered
    /// (unless equal ones already are) and kept as cached; the partial one is freed.
    pub fn release(&mut self, shared: &[u64], computed: &[u64], private: u64) {
        for h in shared {
            if let Some(e) = self.entries.get_mut(h) {
                e.refs = e.refs.saturating_sub(1);
                if e.refs == 0 {
                    e.stamp = self.next_stamp;
                    self.lru.insert(self.next_stamp, *h);
                    self.next_stamp += 1;
                    self.used -= 1;
                }
            }
        }
        self.used -= private;
        if self.caching {
            for h in computed.iter().take(private as usize) {
                if !self.entries.contains_key(h) {
                    self.entries.insert(
                        *h,
                        Entry {
                            refs: 0,
                            stamp: self.next_stamp,
                        },
                    );
                    self.lru.insert(self.next_stamp, *h);
                    self.next_stamp += 1;
                }
            }
        }
    }

    /// Empties the cache (a crash, a shutdown): nothing in use, nothing cached.
    pub fn clear(&mut self) {
        self.used = 0;
        self.entries.clear();
        self.lru.clear();
    }

    /// Checks the bookkeeping (tests).
    #[cfg(test)]
    pub fn check(&self) {
        assert!(self.used + self.lru.len() as u64 <= self.capacity);
        let cached = self.entries.values().filter(|e| e.refs == 0).count();
        assert_eq!(cached, self.lru.len());
        for (stamp, h) in &self.lru {
            assert_eq!(self.entries.get(h).map(|e| e.stamp), Some(*stamp));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_full_blocks() {
        let a: Vec<TokenId> = (0..40).collect();
        let h = block_hashes(&a);
        assert_eq!(h.len(), 2);
        // The same first block gives the same hash; a different first block changes both.
        let mut b = a.clone();
        b[20] = 999;
        assert_eq!(block_hashes(&b)[0], h[0]);
        assert_ne!(block_hashes(&b)[1], h[1]);
        b[0] = 999;
        assert_ne!(block_hashes(&b)[1], h[1]);
        assert!(block_hashes(&a[..15]).is_empty());
    }

    #[test]
    fn released_blocks_are_hits_until_evicted_least_recently_released_first() {
        let mut p = BlockPool::new(6, true);
        // A sequence of 3 blocks (2 full, hashed 1 and 2) runs and leaves.
        p.acquire(&[], 3);
        assert_eq!((p.used(), p.available()), (3, 3));
        p.release(&[], &[1, 2], 3);
        p.check();
        assert_eq!((p.used(), p.cached(), p.available()), (0, 2, 6));
        assert_eq!(p.hits(&[1, 2, 3]), 2);
        assert_eq!(p.hits(&[2]), 1);
        assert_eq!(p.hits(&[9, 1]), 0);
        // A second takes them both plus one fresh block; they are in use, not cached.
        assert_eq!(p.revived(&[1, 2]), 2);
        p.acquire(&[1, 2], 1);
        p.check();
        assert_eq!((p.used(), p.cached()), (3, 0));
        // A third shares them while the second runs: no new blocks for them.
        assert_eq!(p.revived(&[1, 2]), 0);
        p.acquire(&[1, 2], 1);
        assert_eq!(p.used(), 4);
        p.release(&[1, 2], &[30], 1);
        p.release(&[1, 2], &[20], 1);
        p.check();
        // Cached in the order they were released: 30, then 1 and 2, then 20. Filling the
        // cache evicts 30 and 1 first.
        assert_eq!((p.used(), p.cached()), (0, 4));
        p.allocate(4);
        p.check();
        assert_eq!((p.used(), p.cached()), (4, 2));
        assert_eq!((p.hits(&[30]), p.hits(&[1])), (0, 0));
        assert_eq!((p.hits(&[2]), p.hits(&[20])), (1, 1));
        p.clear();
        assert_eq!((p.used(), p.cached(), p.hits(&[20])), (0, 0, 0));
    }

    #[test]
    fn without_caching_nothing_is_kept() {
        let mut p = BlockPool::new(4, false);
        p.acquire(&[], 2);
        p.release(&[], &[1, 2], 2);
        assert_eq!((p.used(), p.cached(), p.hits(&[1])), (0, 0, 0));
    }
}
