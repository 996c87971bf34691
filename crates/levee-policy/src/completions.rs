//! What a streamed answer holds of a backend's KV cache, and how that grows.
//!
//! An engine's cache holds a sequence's prompt and the tokens generated so far, not the
//! `max_tokens` it was asked for. Reserving the whole `max_tokens` of every request keeps a
//! cache that fails on overflow safe, but where clients ask far more than their answers use
//! it fills the budget with tokens that are never generated. A stream, whose tokens levee
//! reads as they come, can instead hold its prompt and a high quantile of the completions
//! this lane's answers were seen to have ([`CompletionSizes`]), and grow that ahead of its
//! tokens ([`Reservation`]): when what has arrived comes within [`Reservation::lead`] of
//! what is held, the hold doubles (never past the request's own budget), and a stream whose
//! backend has no room to grow it is cut short rather than let the cache overflow.
//!
//! The lead covers the tokens an engine may have generated that levee has not yet read; a
//! client that stops reading (its tokens pile up out of levee's sight) is held to its whole
//! budget at once ([`Reservation::whole`]).

use crate::quantile::SortedSamples;
use std::collections::VecDeque;

/// Answers the quantile needs before a stream holds less than its whole budget.
pub const MIN_SAMPLES: usize = 32;
/// Answers kept at most (the oldest go first).
const MAX_SAMPLES: usize = 512;
/// The share of answers a first hold covers.
const QUANTILE: f64 = 0.99;
/// A hold is never smaller than this many completion tokens.
const MIN_HOLD: u64 = 32;
/// Tokens a hold keeps ahead of those read, at least.
const MIN_LEAD: u64 = 16;

/// The completion lengths of a lane's recent answers.
#[derive(Debug, Clone, Default)]
pub struct CompletionSizes {
    samples: VecDeque<u64>,
    sorted: SortedSamples,
}

impl CompletionSizes {
    /// Records an answer of `tokens` completion tokens (or one cut short after `tokens`:
    /// at least that long).
    pub fn note(&mut self, tokens: u64) {
        if self.samples.len() >= MAX_SAMPLES {
            if let Some(old) = self.samples.pop_front() {
                self.sorted.remove(old as f64);
            }
        }
        self.samples.push_back(tokens);
        self.sorted.insert(tokens as f64);
    }

    /// What a stream with a completion budget of `budget` tokens holds at first: the
    /// [`QUANTILE`] of the answers seen (at least [`MIN_HOLD`]), or its tenant's
    /// `tenant_longest` recent answer ([`LongestAnswers`]) if longer, never more than
    /// `budget`; the whole budget until [`MIN_SAMPLES`] answers were seen.
    pub fn first_hold(&self, budget: u64, tenant_longest: Option<u64>) -> u64 {
        if self.samples.len() < MIN_SAMPLES {
            return budget;
        }
        let q = self.sorted.nearest_rank(QUANTILE).unwrap_or(f64::MAX);
        // The cast saturates: a quantile beyond u64 is the budget.
        (q.ceil() as u64)
            .max(tenant_longest.unwrap_or(0))
            .max(MIN_HOLD)
            .min(budget)
    }
}

/// Answers of one tenant remembered.
const TENANT_ANSWERS: usize = 8;
/// Answers of a tenant seen before its longest counts.
const TENANT_MIN: u8 = 2;

/// The completion lengths of one tenant's last answers, so that a tenant whose answers run
/// longer than the lane's (on purpose, as with vLLM's `ignore_eos`, or by its prompts) is
/// admitted holding what its own answers use: judged by the fair-share rule at admission,
/// as a whole budget is, rather than growing past its share and being cut midway.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LongestAnswers {
    last: [u32; TENANT_ANSWERS],
    seen: u8,
    next: u8,
}

impl LongestAnswers {
    /// Records an answer of `tokens` completion tokens (or one cut short after `tokens`).
    pub(crate) fn note(&mut self, tokens: u64) {
        let i = usize::from(self.next) % TENANT_ANSWERS;
        if let Some(slot) = self.last.get_mut(i) {
            *slot = u32::try_from(tokens).unwrap_or(u32::MAX);
        }
        self.next = ((i + 1) % TENANT_ANSWERS) as u8;
        self.seen = self.seen.saturating_add(1);
    }

    /// The longest of the last answers, once [`TENANT_MIN`] were seen.
    pub(crate) fn longest(&self) -> Option<u64> {
        if self.seen < TENANT_MIN {
            return None;
        }
        let n = usize::from(self.seen).min(TENANT_ANSWERS);
        self.last.iter().take(n).copied().max().map(u64::from)
    }
}

/// A stream's backend has no room to grow its hold: cut it short before the engine's cache
/// holds more than was reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBudget;

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the backend's KV budget has no room to hold more of this answer")
    }
}

impl std::error::Error for OverBudget {}

/// A request's completion tokens held in its backend's KV cache: `held` of its `budget`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Completion tokens held now.
    pub held: u64,
    /// Its whole completion budget (`max_tokens` × choices).
    pub budget: u64,
}

impl Reservation {
    /// Tokens the hold keeps ahead of those read: an eighth of it, at least [`MIN_LEAD`].
    pub fn lead(&self) -> u64 {
        (self.held / 8).max(MIN_LEAD)
    }

    /// The count of generated tokens at which it must grow; `None` once it holds its whole
    /// budget.
    pub fn grows_at(&self) -> Option<u64> {
        (self.held < self.budget).then(|| self.held.saturating_sub(self.lead()))
    }

    /// What to hold once `generated` tokens were read, best first: double (or what keeps
    /// the lead ahead of them, if more), then just the lead ahead; never past the budget.
    /// Empty while the hold still keeps its lead.
    pub fn growths(&self, generated: u64) -> impl Iterator<Item = u64> {
        let due = self.grows_at().is_some_and(|at| generated >= at);
        let least = hold_ahead_of(generated.saturating_add(self.lead())).min(self.budget);
        let best = self.held.saturating_mul(2).max(least).min(self.budget);
        let (a, b) = if due {
            (Some(best), (least < best).then_some(least))
        } else {
            (None, None)
        };
        let held = self.held;
        a.into_iter().chain(b).filter(move |&h| h > held)
    }

    /// What to hold for a stream whose tokens levee may no longer see as they come: all of
    /// it.
    pub fn whole(&self) -> u64 {
        self.budget
    }
}

/// The least hold whose lead stays ahead of `generated` tokens read: `h − lead(h) > g`.
fn hold_ahead_of(generated: u64) -> u64 {
    // With h ≥ 8·MIN_LEAD the lead is h/8 (rounded down), and h − h/8 ≥ 7h/8 > g once
    // h ≥ 8g/7 + 2; below, the lead is MIN_LEAD.
    generated.saturating_add(MIN_LEAD + 1).max(
        (generated / 7)
            .saturating_mul(8)
            .saturating_add(generated % 7 * 8 / 7 + 2),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_hold_is_the_whole_budget_until_enough_answers_were_seen() {
        let mut s = CompletionSizes::default();
        for _ in 0..MIN_SAMPLES - 1 {
            s.note(100);
        }
        assert_eq!(s.first_hold(2048, None), 2048);
        s.note(100);
        assert_eq!(s.first_hold(2048, None), 100);
        assert_eq!(s.first_hold(64, None), 64, "never past the budget");
    }

    #[test]
    fn the_first_hold_covers_the_high_quantile_of_the_window() {
        let mut s = CompletionSizes::default();
        for t in 1..=100 {
            s.note(t * 10);
        }
        // 99th percentile of 10..=1000 by nearest rank.
        assert_eq!(s.first_hold(4096, None), 990);
        // The window forgets the oldest.
        for _ in 0..MAX_SAMPLES {
            s.note(5);
        }
        assert_eq!(s.first_hold(4096, None), MIN_HOLD);
    }

    #[test]
    fn a_tenants_longest_recent_answer_raises_its_first_hold_once_a_few_were_seen() {
        let mut s = CompletionSizes::default();
        for _ in 0..MIN_SAMPLES {
            s.note(100);
        }
        let mut t = LongestAnswers::default();
        for _ in 0..TENANT_MIN - 1 {
            t.note(1_000);
        }
        assert_eq!(t.longest(), None, "too few of its answers seen");
        t.note(1_000);
        assert_eq!(s.first_hold(2_048, t.longest()), 1_000);
        assert_eq!(s.first_hold(512, t.longest()), 512, "never past the budget");
        // Shorter than the lane's: the lane's quantile stands.
        assert_eq!(s.first_hold(2_048, Some(50)), 100);
        // Its last eight answers are what count.
        for _ in 0..TENANT_ANSWERS {
            t.note(20);
        }
        assert_eq!(t.longest(), Some(20));
    }

    #[test]
    fn a_hold_doubles_when_its_lead_is_reached_and_stops_at_the_budget() {
        let r = Reservation {
            held: 256,
            budget: 2048,
        };
        assert_eq!(r.lead(), 32);
        assert_eq!(r.grows_at(), Some(224));
        assert_eq!(r.growths(223).count(), 0);
        assert_eq!(r.growths(224).collect::<Vec<_>>(), vec![512, 294]);
        let r = Reservation {
            held: 1500,
            budget: 2048,
        };
        assert_eq!(r.growths(1400).collect::<Vec<_>>(), vec![2048, 1815]);
        let r = Reservation {
            held: 2048,
            budget: 2048,
        };
        assert_eq!(r.grows_at(), None);
        assert_eq!(r.growths(5000).count(), 0);
    }

    proptest::proptest! {
        /// Whatever the hold and the tokens read, a growth keeps the lead ahead of them (or
        /// reaches the budget), and never passes the budget.
        #[test]
        fn a_growth_keeps_the_lead_or_reaches_the_budget(
            held in 1u64..5000,
            extra in 0u64..5000,
            generated in 0u64..10_000,
        ) {
            let r = Reservation { held, budget: held + extra };
            for h in r.growths(generated) {
                proptest::prop_assert!(h <= r.budget && h > r.held);
                let kept = Reservation { held: h, budget: r.budget };
                proptest::prop_assert!(
                    h == r.budget || kept.grows_at().is_some_and(|at| at > generated),
                    "hold {} after {} read: lead lost", h, generated
                );
            }
        }
    }
}
