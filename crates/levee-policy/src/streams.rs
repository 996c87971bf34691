//! The streams whose KV hold grows ([`crate::LaneConfig::grow_streams`]), as their lane knows
//! them to take room back for a tenant within its fair share.
//!
//! A stream is admitted holding what answers were seen to use, then grows as its tokens
//! come. Growth is judged by the tenant's share as well as by the backend's room, but a
//! tenant whose streams grew while the others were quiet may hold more than its share when
//! a stream of a tenant within its share needs to grow and the backend is full. Then the
//! youngest streams of the tenants over their share, lowest tier first, are cut short for
//! it: their hold goes to the grower at once, and the caller drops their connections, which
//! stops them at the engine's next step — within the lead (at least 16 tokens) a growth
//! keeps ahead of the grower's tokens, so the engine never holds both.

use crate::clock::Timestamp;
use crate::queue::Tier;
use std::num::NonZeroU32;
use std::sync::Arc;

/// A growing stream, as the caller names it to cut it short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamId(NonZeroU32);

impl StreamId {
    /// A number that names it in the caller's own map.
    pub fn get(self) -> u64 {
        u64::from(self.0.get())
    }
}

#[derive(Debug)]
struct Growing<K> {
    id: NonZeroU32,
    tenant: K,
    tier: Tier,
    backend: Arc<str>,
    at: Timestamp,
    /// KV tokens it holds.
    held: u64,
    /// Its hold went to another stream: it is to be cut short, and never grows again.
    taken: bool,
    /// A growth of it was refused: it is cut short.
    refused: bool,
}

/// A stream whose hold was taken ([`Streams::take`]): its tenant, tier and the tokens it
/// held, which its lane gives back at once.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Taken<K> {
    pub tenant: K,
    pub tier: Tier,
    pub held: u64,
}

/// The lane's growing streams, and the ones whose hold was taken that its caller has yet to
/// cut short.
#[derive(Debug)]
pub(crate) struct Streams<K> {
    streams: Vec<Growing<K>>,
    to_cut: Vec<StreamId>,
    next: u32,
}

impl<K> Default for Streams<K> {
    fn default() -> Self {
        Streams {
            streams: Vec::new(),
            to_cut: Vec::new(),
            next: 0,
        }
    }
}

impl<K> Streams<K> {
    /// Registers a stream of `tenant` and `tier` placed on `backend` at `at`, holding
    /// `held` KV tokens.
    pub(crate) fn register(
        &mut self,
        tenant: K,
        tier: Tier,
        backend: Arc<str>,
        at: Timestamp,
        held: u64,
    ) -> StreamId {
        // Numbers wrap after 2³² − 1 streams: by then none of the first is still running.
        self.next = self.next.checked_add(1).unwrap_or(1);
        let id = NonZeroU32::new(self.next).unwrap_or(NonZeroU32::MIN);
        self.streams.push(Growing {
            id,
            tenant,
            tier,
            backend,
            at,
            held,
            taken: false,
            refused: false,
        });
        StreamId(id)
    }

    fn find(&self, id: StreamId) -> Option<&Growing<K>> {
        self.streams.iter().find(|s| s.id == id.0)
    }

    /// Whether its hold was taken (it is to be cut short).
    pub(crate) fn taken(&self, id: StreamId) -> bool {
        self.find(id).is_some_and(|s| s.taken)
    }

    /// A growth of it was refused (it is cut short).
    pub(crate) fn refuse(&mut self, id: StreamId) {
        if let Some(s) = self.streams.iter_mut().find(|s| s.id == id.0) {
            s.refused = true;
        }
    }

    /// Whether it is cut short for want of room: its hold was taken, or a growth refused.
    pub(crate) fn cut(&self, id: StreamId) -> bool {
        self.find(id).is_some_and(|s| s.taken || s.refused)
    }

    /// It holds `held` KV tokens now.
    pub(crate) fn grew(&mut self, id: StreamId, held: u64) {
        if let Some(s) = self.streams.iter_mut().find(|s| s.id == id.0) {
            s.held = held;
        }
    }

    /// It ended: the KV tokens of its hold that were taken from it (already given back).
    pub(crate) fn released(&mut self, id: StreamId) -> u64 {
        let Some(i) = self.streams.iter().position(|s| s.id == id.0) else {
            return 0;
        };
        let s = self.streams.swap_remove(i);
        if s.taken {
            self.to_cut.retain(|c| *c != id);
            s.held
        } else {
            0
        }
    }

    /// Takes the holds of streams on `backend` other than `grower`, at tier `top` or below,
    /// whose tenant `over` names, until they hold `short` tokens: the lowest tier first,
    /// then the youngest (the least work lost). `None`, and nothing taken, if all of them
    /// hold less.
    pub(crate) fn take(
        &mut self,
        backend: &str,
        top: Tier,
        short: u64,
        grower: StreamId,
        over: impl Fn(&K) -> bool,
    ) -> Option<Vec<Taken<K>>>
    where
        K: Clone,
    {
        let mut candidates: Vec<usize> = (0..self.streams.len())
            .filter(|&i| {
                let s = &self.streams[i];
                !s.taken
                    && s.id != grower.0
                    && s.tier.0 >= top.0
                    && &*s.backend == backend
                    && over(&s.tenant)
            })
            .collect();
        // Lowest tier (largest number) first, then the youngest.
        candidates.sort_by_key(|&i| {
            let s = &self.streams[i];
            std::cmp::Reverse((s.tier.0, s.at, s.id))
        });
        let mut sum = 0u64;
        let chosen: Vec<usize> = candidates
            .into_iter()
            .take_while(|&i| {
                let enough = sum >= short;
                sum = sum.saturating_add(self.streams[i].held);
                !enough
            })
            .collect();
        if sum < short {
            return None;
        }
        let taken = chosen
            .into_iter()
            .map(|i| {
                let s = &mut self.streams[i];
                s.taken = true;
                self.to_cut.push(StreamId(s.id));
                Taken {
                    tenant: s.tenant.clone(),
                    tier: s.tier,
                    held: s.held,
                }
            })
            .collect();
        Some(taken)
    }

    /// The streams whose hold was taken since the last call: the caller cuts them short.
    pub(crate) fn take_cuts(&mut self) -> Vec<StreamId> {
        std::mem::take(&mut self.to_cut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(ms: u64) -> Timestamp {
        Timestamp::ZERO + Duration::from_millis(ms)
    }

    #[test]
    fn the_lowest_tier_then_the_youngest_over_share_streams_are_taken_until_they_cover() {
        let mut s = Streams::default();
        let b: Arc<str> = Arc::from("b0");
        let old = s.register("flood", Tier(1), b.clone(), at(0), 300);
        let young = s.register("flood", Tier(1), b.clone(), at(10), 100);
        let low = s.register("flood", Tier(2), b.clone(), at(5), 50);
        let elsewhere = s.register("flood", Tier(2), Arc::from("b1"), at(20), 900);
        let premium = s.register("flood", Tier(0), b.clone(), at(30), 900);
        let quiet = s.register("quiet", Tier(1), b.clone(), at(40), 100);
        let flood = |k: &&str| *k == "flood";
        // Nothing over share on b0 at tier 1 or below holds 500: nothing is taken.
        assert_eq!(s.take("b0", Tier(1), 500, quiet, flood), None);
        assert!(s.take_cuts().is_empty());
        // 120: the lowest tier's (50), then the youngest of tier 1 (100).
        let taken = s.take("b0", Tier(1), 120, quiet, flood).unwrap();
        assert_eq!(
            taken.iter().map(|t| t.held).collect::<Vec<_>>(),
            vec![50, 100]
        );
        assert_eq!(s.take_cuts(), vec![low, young]);
        assert!(s.taken(low) && s.taken(young) && !s.taken(old));
        assert!(s.cut(young) && !s.cut(old));
        s.refuse(old);
        assert!(s.cut(old) && !s.taken(old), "refused, not taken");
        // A taken stream gives back nothing more when it ends; an untaken one nothing.
        assert_eq!(s.released(young), 100);
        assert_eq!(s.released(old), 0);
        let _ = (elsewhere, premium);
    }

    #[test]
    fn a_taken_stream_that_ends_before_it_was_cut_is_not_cut() {
        let mut s = Streams::default();
        let b: Arc<str> = Arc::from("b0");
        let flood = s.register("flood", Tier(0), b.clone(), at(0), 300);
        let quiet = s.register("quiet", Tier(0), b, at(1), 100);
        assert!(s
            .take("b0", Tier(0), 10, quiet, |k| *k == "flood")
            .is_some());
        assert_eq!(s.released(flood), 300);
        assert!(s.take_cuts().is_empty());
    }
}
