//! Preemption of over-share work (see [`crate::LaneConfig::preempt`]): the running requests a
//! lane may still take back, and those it asked to be cut short.
//!
//! A request is preemptible from its placement until its answer starts reaching its client
//! ([`crate::LaneAdmission::answered`]); nothing of it has reached anyone, so cutting it
//! short and sending it again later loses only the engine's work on it. The lane takes back
//! the youngest one (the least work lost) of a tenant whose traffic is over its fair share
//! and that holds more than its share of the slots, when every slot is busy and a tenant
//! under its share has a request waiting: the flooder keeps its share, and the quiet
//! tenants' bursts find a slot at once instead of waiting for the flooder's to end.

use crate::clock::Timestamp;
use crate::queue::Tier;
use std::num::NonZeroU32;

/// A preemptible running request, as the caller names it to cut it short (kept small: every
/// placement carries one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RunId(NonZeroU32);

impl RunId {
    /// A number that names it in the caller's own map.
    pub fn get(self) -> u64 {
        u64::from(self.0.get())
    }
}

#[derive(Debug)]
struct Run<K> {
    id: NonZeroU32,
    tenant: K,
    tier: Tier,
    at: Timestamp,
    /// Answered only when it ends: preemptible through its run.
    lasting: bool,
}

/// The lane's preemptible running requests, and the ones it asked to be cut short whose
/// slot has not come back yet.
#[derive(Debug)]
pub(crate) struct Runs<K> {
    runs: Vec<Run<K>>,
    victims: Vec<NonZeroU32>,
    next: u32,
}

impl<K> Default for Runs<K> {
    fn default() -> Self {
        Runs {
            runs: Vec::new(),
            victims: Vec::new(),
            next: 0,
        }
    }
}

impl<K: PartialEq> Runs<K> {
    /// Registers a request of `tenant` and `tier` placed at `at`.
    pub(crate) fn register(&mut self, tenant: K, tier: Tier, at: Timestamp) -> RunId {
        // Numbers wrap after 2³² − 1 requests: by then none of the first is still running.
        self.next = self.next.checked_add(1).unwrap_or(1);
        let id = NonZeroU32::new(self.next).unwrap_or(NonZeroU32::MIN);
        self.runs.push(Run {
            id,
            tenant,
            tier,
            at,
            lasting: false,
        });
        RunId(id)
    }

    /// It is answered only when it ends: preemptible through its run. Whether it still is
    /// preemptible.
    pub(crate) fn lend(&mut self, id: RunId) -> bool {
        let run = self.runs.iter_mut().find(|r| r.id == id.0);
        run.map(|r| r.lasting = true).is_some()
    }

    /// Its answer started: no longer preemptible. Whether it still was, and if so whether
    /// it was lasting ([`Runs::lend`]).
    pub(crate) fn answered(&mut self, id: RunId) -> Option<bool> {
        let i = self.runs.iter().position(|r| r.id == id.0)?;
        Some(self.runs.swap_remove(i).lasting)
    }

    /// Its slot came back (it ended, or was cut short). As [`Runs::answered`]: `None` if it
    /// was no longer preemptible (answered, or chosen).
    pub(crate) fn released(&mut self, id: RunId) -> Option<bool> {
        if let Some(i) = self.victims.iter().position(|v| *v == id.0) {
            self.victims.swap_remove(i);
            return None;
        }
        self.answered(id)
    }

    /// Requests chosen to be cut short whose slot has not come back yet.
    pub(crate) fn pending(&self) -> usize {
        self.victims.len()
    }

    /// How many requests [`Runs::choose`] could name with the same arguments.
    pub(crate) fn available(&self, top: Tier, eligible: impl Fn(&K) -> bool) -> usize {
        self.candidates(top, eligible).count()
    }

    /// The preemptible requests of a tier at or below `top` whose tenant `eligible` names,
    /// with their index.
    fn candidates(
        &self,
        top: Tier,
        eligible: impl Fn(&K) -> bool,
    ) -> impl Iterator<Item = (usize, &Run<K>)> {
        self.runs
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.tier.0 >= top.0 && eligible(&r.tenant))
    }

    /// The youngest preemptible request of a tier at or below `top` (a priority number at
    /// least `top`'s) whose tenant `eligible` names, taken out of the preemptible ones and
    /// counted as pending until its slot comes back; with its tenant and whether it was
    /// lasting ([`Runs::lend`]).
    pub(crate) fn choose(
        &mut self,
        top: Tier,
        eligible: impl Fn(&K) -> bool,
    ) -> Option<(RunId, K, bool)> {
        let i = self
            .candidates(top, eligible)
            .max_by_key(|(_, r)| (r.at, r.id))
            .map(|(i, _)| i)?;
        let r = self.runs.swap_remove(i);
        self.victims.push(r.id);
        Some((RunId(r.id), r.tenant, r.lasting))
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
    fn the_youngest_eligible_run_is_chosen_once_and_counted_until_released() {
        let mut runs = Runs::default();
        let old = runs.register("flooder", Tier(1), at(0));
        let young = runs.register("flooder", Tier(1), at(20));
        let quiet = runs.register("quiet", Tier(1), at(30));
        let answered = runs.register("flooder", Tier(1), at(40));
        assert_eq!(runs.answered(answered), Some(false));
        let flooder = |k: &&str| *k == "flooder";
        assert!(runs.lend(young));
        assert_eq!(
            runs.choose(Tier(1), flooder),
            Some((young, "flooder", true))
        );
        assert_eq!(runs.pending(), 1);
        assert_eq!(runs.choose(Tier(1), flooder), Some((old, "flooder", false)));
        assert_eq!(
            runs.choose(Tier(1), flooder),
            None,
            "nothing else of the flooder's is preemptible"
        );
        // A chosen run coming back is no longer pending, and was not preemptible any more.
        assert_eq!(runs.released(young), None);
        assert_eq!(runs.pending(), 1);
        // A run still preemptible when it ends.
        assert_eq!(runs.released(quiet), Some(false));
        assert_eq!(runs.released(answered), None, "answered before it ended");
        assert!(!runs.lend(answered), "no longer preemptible");
    }

    #[test]
    fn a_run_of_a_higher_priority_than_the_waiting_request_is_never_chosen() {
        let mut runs = Runs::default();
        runs.register("flooder", Tier(0), at(10));
        assert_eq!(runs.choose(Tier(1), |_| true), None);
        let low = runs.register("flooder", Tier(2), at(5));
        assert_eq!(
            runs.choose(Tier(1), |_| true),
            Some((low, "flooder", false))
        );
    }
}
