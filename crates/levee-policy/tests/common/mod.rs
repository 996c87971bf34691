//! What the time-simulated fleet tests share: requests holding a backend until their end,
//! each grant settled with the admission state when its end comes.

/// Not every test file runs the same-tier flood.
#[allow(dead_code)]
pub mod same_tier;

use levee_policy::{Admission, Completion, Grant, Outcome, Timestamp};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Requests running on the simulated fleet, by end time.
#[derive(Default)]
pub struct Running {
    ends: BinaryHeap<Reverse<(Timestamp, u64)>>,
    grants: HashMap<u64, Grant<&'static str>>,
    next_id: u64,
}

impl Running {
    /// `grant` holds its backend until `end`.
    pub fn start(&mut self, grant: Grant<&'static str>, end: Timestamp) {
        self.next_id += 1;
        self.ends.push(Reverse((end, self.next_id)));
        self.grants.insert(self.next_id, grant);
    }

    /// Takes out the running request named `run` among the preemptible ones (cut short).
    #[allow(dead_code)] // only the isolation test cuts requests short
    pub fn take_run(&mut self, run: levee_policy::RunId) -> Option<Grant<&'static str>> {
        let id = *self
            .grants
            .iter()
            .find(|(_, g)| g.run() == Some(run))
            .map(|(id, _)| id)?;
        self.grants.remove(&id)
    }

    /// Settles, successfully, every request that ended by `now`.
    pub fn finish_until<T>(&mut self, adm: &mut Admission<T, &'static str>, now: Timestamp) {
        while let Some(Reverse((end, id))) = self.ends.peek().copied() {
            if end > now {
                break;
            }
            self.ends.pop();
            if let Some(g) = self.grants.remove(&id) {
                let done = Completion {
                    outcome: Outcome::Success,
                    actual_tokens: None,
                    generated: None,
                };
                adm.complete(g, done, now);
            }
        }
    }
}
