//! A backend's budget shared by a fleet of gateway replicas.
//!
//! One engine's sequence slots and KV-cache tokens are one budget however many gateways
//! send to it. Each replica leases a *slice* of every backend's budget from the shared state
//! and admits against its slice only, so the decision stays local and cheap: the slices the
//! shared state hands out never add up to more than the budget, hence neither do the
//! requests the replicas admit.
//!
//! This module is the arithmetic, apart from any I/O:
//!
//! * [`slice_want`] — what a replica asks for, per priority class (tier): what it uses and
//!   what waits in its queue of that tier, and a margin to grow into before its next
//!   renewal, never more than the whole budget.
//! * [`tiered_split`] — how the shared state splits a budget when the replicas together want
//!   more than it holds: class by class, highest first, so that the fleet serves a higher
//!   tier's demand on any replica before a lower tier's on any other (as one gateway's queue
//!   does); within a class max-min fair ([`fair_split`]: each gets its want when it wants
//!   less than an equal share; the rest split equally among the others). The Redis script
//!   that decides leases implements the same rule; levee-store's tests hold the two against
//!   each other.
//! * [`FleetLedger`] — one replica's view: the last grant per backend, what it may admit
//!   now ([`FleetLedger::allowance`]), and the figure it used before its first grant or
//!   while the shared state does not answer (it keeps its current slice).
//!
//! A grant is `min(tiered share, budget − what the others hold)`; a replica's holding in the
//! shared state is `max(grant, what it may run)`, what it may run being the larger of what
//! it has in flight and the slice it admits against until the answer reaches it (requests
//! admitted during the round trip are not in the demand it sent). So a replica whose slice
//! shrank keeps counting what it still runs until that ends, and its old slice until it has
//! stopped admitting into it. Holdings expire after the lease time
//! unless renewed: a dead replica's slice comes back to the others then.

use crate::clock::Timestamp;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Sequence slots and KV-cache tokens of one backend (or a slice of them). `kv_tokens = 0`
/// means the KV budget is not known, and only slots are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Budget {
    /// Requests in flight.
    pub slots: u64,
    /// KV-cache tokens (prompt estimate + completion budget of requests in flight).
    pub kv_tokens: u64,
}

/// What one replica has of a backend and waiting for it, in one priority class (a tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceDemand {
    /// Requests it has in flight there.
    pub in_flight: u64,
    /// KV tokens it has reserved there.
    pub kv_in_flight: u64,
    /// Requests waiting in its queue for this backend (its share of the lane's queue).
    pub queued: u64,
    /// Their KV tokens.
    pub queued_kv: u64,
}

/// Slots a replica asks for beyond its demand, at least: room to take new requests before
/// its next renewal.
pub const MIN_MARGIN_SLOTS: u64 = 2;

/// What a replica asks the fleet for, per priority class (`tiers[0]` the highest tier; one
/// entry per tier): in each, what it has in flight and queued of that tier, plus a margin to
/// grow into until the next renewal — a quarter of that tier's use, and in all at least
/// [`MIN_MARGIN_SLOTS`] slots (the shortfall counted in the highest tier it has demand in,
/// the first when it has none) — and as many KV tokens per margin slot as the largest of:
/// the tier's requests in flight on average, its queued ones on average, the budget per
/// slot. The classes add up to at most the budget (the lowest ones are cut first).
pub fn slice_want(budget: Budget, tiers: &[SliceDemand]) -> Vec<Budget> {
    let per_slot_of = |d: &SliceDemand| {
        [
            budget.kv_tokens.checked_div(budget.slots),
            d.kv_in_flight.checked_div(d.in_flight),
            d.queued_kv.checked_div(d.queued),
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0)
    };
    let mut margins: Vec<u64> = tiers.iter().map(|d| d.in_flight.div_ceil(4)).collect();
    if margins.is_empty() {
        margins.push(0);
    }
    let shortfall = MIN_MARGIN_SLOTS.saturating_sub(margins.iter().sum());
    let first = tiers
        .iter()
        .position(|d| d.in_flight + d.queued > 0)
        .unwrap_or(0);
    margins[first] += shortfall;
    let mut left = budget;
    margins
        .iter()
        .enumerate()
        .map(|(t, &margin)| {
            let d = tiers.get(t).copied().unwrap_or_default();
            let slots = d
                .in_flight
                .saturating_add(d.queued)
                .saturating_add(margin)
                .min(left.slots);
            let kv_tokens = d
                .kv_in_flight
                .saturating_add(d.queued_kv)
                .saturating_add(margin.saturating_mul(per_slot_of(&d)))
                .min(left.kv_tokens);
            left.slots -= slots;
            left.kv_tokens -= kv_tokens;
            Budget { slots, kv_tokens }
        })
        .collect()
}

/// Splits `budget` over `wants`, max-min fair: taken in ascending order of want (ties: the
/// earlier entry first), each gets the smaller of its want and an equal part of what is
/// left. Every entry gets at most its want, the parts add up to
/// `min(Σ wants, budget)`, and an entry that gets less than its want gets no less than any
/// other entry's part, less one (integer division).
pub fn fair_split(wants: &[u64], budget: u64) -> Vec<u64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut out = vec![0; wants.len()];
    let mut left = budget;
    let n = order.len() as u64;
    for (k, &i) in order.iter().enumerate() {
        let share = left / (n - k as u64);
        let part = wants[i].min(share);
        out[i] = part;
        left -= part;
    }
    out
}

/// Splits `budget` over entries that each want something per priority class
/// (`wants[i][c]`, class 0 first; a missing class wants nothing), class by class: the first
/// class's wants are split max-min fair ([`fair_split`]) over the whole budget, the next
/// class's over what is left, and so on. No entry gets anything for a class while another
/// entry's want in a higher class is not met in full; within a class the split is
/// [`fair_split`]'s. Returns each entry's total.
pub fn tiered_split(wants: &[Vec<u64>], budget: u64) -> Vec<u64> {
    let classes = wants.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = vec![0u64; wants.len()];
    let mut left = budget;
    for c in 0..classes {
        let column: Vec<u64> = wants
            .iter()
            .map(|w| w.get(c).copied().unwrap_or(0))
            .collect();
        for (o, part) in out.iter_mut().zip(fair_split(&column, left)) {
            *o += part;
            left -= part;
        }
    }
    out
}

/// The shared state's answer to one lease or renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceGrant {
    /// What this replica may have in flight there until its next renewal.
    pub allowed: Budget,
    /// What the other live replicas hold there.
    pub others: Budget,
    /// Live replicas holding a slice of this backend, this one included.
    pub replicas: u32,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    grant: SliceGrant,
    at: Timestamp,
}

/// One replica's slices of the fleet's backends.
#[derive(Debug, Clone)]
pub struct FleetLedger {
    lease: Duration,
    held: HashMap<Arc<str>, Held>,
}

impl FleetLedger {
    /// A ledger whose leases live `lease` after each renewal.
    pub fn new(lease: Duration) -> Self {
        FleetLedger {
            lease,
            held: HashMap::new(),
        }
    }

    /// The lease time.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Records a grant for `backend` at `now`.
    pub fn granted(&mut self, backend: &Arc<str>, grant: SliceGrant, now: Timestamp) {
        self.held.insert(backend.clone(), Held { grant, at: now });
    }

    /// The last grant for `backend`, if any.
    pub fn grant(&self, backend: &str) -> Option<SliceGrant> {
        self.held.get(backend).map(|h| h.grant)
    }

    /// Whether the last grant for `backend` is older than the lease (the shared state has
    /// not answered since; the others may have taken it over).
    pub fn lapsed(&self, backend: &str, now: Timestamp) -> bool {
        self.held
            .get(backend)
            .is_some_and(|h| now.saturating_duration_since(h.at) > self.lease)
    }

    /// What this replica may admit to `backend` of `budget` now: its last grant (capped by
    /// the budget, which may have shrunk since), kept while the shared state does not
    /// answer. Before its first grant, an equal part of the budget over the `live` replicas
    /// last counted (at least one slot).
    pub fn allowance(&self, backend: &str, budget: Budget, live: u32) -> Budget {
        match self.held.get(backend) {
            Some(h) => Budget {
                slots: h.grant.allowed.slots.min(budget.slots),
                kv_tokens: h.grant.allowed.kv_tokens.min(budget.kv_tokens),
            },
            None => {
                let live = u64::from(live.max(1));
                Budget {
                    slots: (budget.slots / live).max(1).min(budget.slots),
                    kv_tokens: budget.kv_tokens / live,
                }
            }
        }
    }

    /// The backends this replica holds a grant for.
    pub fn backends(&self) -> Vec<Arc<str>> {
        self.held.keys().cloned().collect()
    }

    /// Forgets backends not in `keep` (removed by a reload).
    pub fn retain(&mut self, keep: &[Arc<str>]) {
        self.held.retain(|k, _| keep.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_gives_small_wants_in_full_and_the_rest_equally() {
        assert_eq!(fair_split(&[2, 10, 10], 12), vec![2, 5, 5]);
        assert_eq!(fair_split(&[8, 8, 8], 8), vec![2, 3, 3]);
        assert_eq!(fair_split(&[1, 1], 8), vec![1, 1]);
        assert_eq!(fair_split(&[], 8), Vec::<u64>::new());
    }

    #[test]
    fn tiered_split_serves_a_higher_class_on_any_entry_first() {
        // Replica 0 has premium waiting (class 0), replica 1 only standard (class 1): the
        // split by totals gave each half, starving premium while standard was served.
        let wants = vec![vec![8, 0], vec![0, 16]];
        assert_eq!(fair_split(&[8, 16], 12), vec![6, 6]);
        assert_eq!(tiered_split(&wants, 12), vec![8, 4]);
        // Within a class, max-min fair; what is left goes to the next class.
        let wants = vec![vec![2, 10], vec![10, 0], vec![10, 5]];
        assert_eq!(tiered_split(&wants, 16), vec![2, 7, 7]);
        assert_eq!(tiered_split(&wants, 30), vec![6, 10, 14]);
        // One class: the plain split.
        assert_eq!(
            tiered_split(&[vec![2], vec![10], vec![10]], 12),
            vec![2, 5, 5]
        );
        assert_eq!(tiered_split(&[], 8), Vec::<u64>::new());
        assert_eq!(tiered_split(&[vec![], vec![3]], 8), vec![0, 3]);
    }

    #[test]
    fn want_is_use_queue_and_margin_within_the_budget() {
        let b = Budget {
            slots: 16,
            kv_tokens: 16_000,
        };
        let d = SliceDemand {
            in_flight: 4,
            kv_in_flight: 3_000,
            queued: 1,
            queued_kv: 500,
        };
        // margin: max(2, 4/4) = 2 slots, 2 × 1000 tokens (the budget per slot; in flight
        // 750 on average, queued 500).
        assert_eq!(
            slice_want(b, &[d]),
            vec![Budget {
                slots: 7,
                kv_tokens: 5_500
            }]
        );
        let flood = SliceDemand {
            in_flight: 16,
            kv_in_flight: 15_000,
            queued: 40,
            queued_kv: 40_000,
        };
        assert_eq!(slice_want(b, &[flood]), vec![b]);
        assert_eq!(slice_want(b, &[])[0].slots, 2);
        assert_eq!(slice_want(b, &[SliceDemand::default(); 3])[0].slots, 2);
    }

    #[test]
    fn want_per_tier_keeps_each_tiers_demand_in_its_class() {
        let b = Budget {
            slots: 16,
            kv_tokens: 16_000,
        };
        let premium = SliceDemand {
            in_flight: 0,
            kv_in_flight: 0,
            queued: 1,
            queued_kv: 4_000,
        };
        let standard = SliceDemand {
            in_flight: 8,
            kv_in_flight: 8_000,
            queued: 20,
            queued_kv: 20_000,
        };
        let w = slice_want(b, &[premium, standard]);
        // Premium: its queued request and the margin's shortfall (2 − 8/4 = 0: none) → 1
        // slot, 4,000 tokens. Standard: 8 + 20 + 2 slots, cut to the 15 left; its tokens
        // cut to the 12,000 left.
        assert_eq!(
            w,
            vec![
                Budget {
                    slots: 1,
                    kv_tokens: 4_000
                },
                Budget {
                    slots: 15,
                    kv_tokens: 12_000
                }
            ]
        );
        // Idle in the first tier: the minimum margin goes to the first tier with demand.
        let w = slice_want(b, &[SliceDemand::default(), premium]);
        assert_eq!(w[0], Budget::default());
        assert_eq!(w[1].slots, 3);
    }

    #[test]
    fn allowance_is_the_grant_or_an_equal_part_before_one() {
        let mut l = FleetLedger::new(Duration::from_millis(300));
        let id: Arc<str> = Arc::from("b");
        let b = Budget {
            slots: 9,
            kv_tokens: 900,
        };
        assert_eq!(
            l.allowance("b", b, 3),
            Budget {
                slots: 3,
                kv_tokens: 300
            }
        );
        let t0 = Timestamp::from_nanos(1_000_000_000);
        let g = SliceGrant {
            allowed: Budget {
                slots: 5,
                kv_tokens: 1_000,
            },
            others: Budget::default(),
            replicas: 2,
        };
        l.granted(&id, g, t0);
        // Capped by a budget that shrank.
        assert_eq!(
            l.allowance("b", b, 3),
            Budget {
                slots: 5,
                kv_tokens: 900
            }
        );
        assert!(!l.lapsed("b", t0 + Duration::from_millis(300)));
        assert!(l.lapsed("b", t0 + Duration::from_millis(301)));
        // Kept while the shared state does not answer.
        assert_eq!(l.allowance("b", b, 1).slots, 5);
        l.retain(&[]);
        assert_eq!(l.grant("b"), None);
    }
}
