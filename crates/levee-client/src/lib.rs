//! levee-client: retry and backoff policy for clients of levee (and of any
//! OpenAI-compatible endpoint).
//!
//! The policy is pure: every decision takes the current time and a random number
//! generator as arguments, so it can be tested with a seeded RNG and a manual clock.
//! [`Client`] is a thin async wrapper over reqwest that applies the policy to
//! `/v1/chat/completions` calls.
//!
//! The three rules a well-behaved client follows when a server is overloaded:
//! - wait a random time between zero and an exponentially growing cap before a retry
//!   ([`Backoff`], "full jitter"), so retries from many clients spread out instead of
//!   arriving together;
//! - wait at least as long as the server asked ([`retry_after`]: `Retry-After` in seconds or
//!   as an HTTP date, or `retry-after-ms`);
//! - retry at most a fixed share of requests ([`RetryBudget`]), so that retries can never
//!   multiply the load on a server that is already failing.
//!
//! Two more for levee in particular: the wait a server asked for is spread by a random share
//! of it (`RetryPolicy::retry_after_jitter`), so clients refused together do not return
//! together; and an answer marked `x-levee-degraded` ([`Degradation`]) is final, never retried.

mod backoff;
mod budget;
mod client;
mod degraded;
mod policy;
pub mod retry_after;

pub use backoff::Backoff;
pub use budget::{RetryBudget, RetryBudgetConfig};
pub use client::{Client, ClientError};
pub use degraded::Degradation;
pub use policy::{Decision, GiveUp, Outcome, RetryPolicy};
