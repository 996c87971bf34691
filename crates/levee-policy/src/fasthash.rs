//! A small, fast, seeded hasher (a folded-multiply mix with a per-process random seed) for
//! maps keyed by identities the gateway has already authenticated (tenants, models), where
//! SipHash's flooding resistance buys nothing and costs a large share of a decision.
//! Maps keyed by client-controlled values (IP addresses) keep `std`'s `RandomState`.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

const K: u64 = 0x517c_c1b7_2722_0a95;

/// Builds [`FastHasher`]s seeded once per process.
#[derive(Debug, Clone, Copy)]
pub struct FastState {
    seed: u64,
}

impl Default for FastState {
    fn default() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed = *SEED.get_or_init(|| RandomState::new().hash_one(0x006c_6576_6565_u64));
        FastState { seed }
    }
}

impl BuildHasher for FastState {
    type Hasher = FastHasher;
    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher { hash: self.seed }
    }
}

/// The hasher built by [`FastState`].
#[derive(Debug, Clone, Copy)]
pub struct FastHasher {
    hash: u64,
}

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        // Folded multiply (as in foldhash/ahash): the 128-bit product's halves XORed, so
        // every input bit reaches every output bit (a plain 64-bit multiply only carries
        // upward and collides on keys that differ in their high bytes).
        let p = (self.hash ^ word) as u128 * K as u128;
        self.hash = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        // A final avalanche so the low bits hashbrown uses depend on every input bit.
        let mut h = self.hash;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn distinct_keys_distinct_hashes() {
        let s = FastState::default();
        let hs: HashSet<u64> = (0..10_000)
            .map(|i| s.hash_one(format!("tenant-{i}")))
            .collect();
        assert_eq!(hs.len(), 10_000);
        assert_ne!(s.hash_one("ab"), s.hash_one("ba"));
        assert_ne!(s.hash_one(("a", "bc")), s.hash_one(("ab", "c")));
    }
}
